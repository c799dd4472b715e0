"""A slice's snapshots: a copy at exactly one version, taken while training runs (just before
the step that would leave it), and a slice rebuilt from a snapshot."""

from __future__ import annotations

from typing import Any

from paramshard.protos import shard_pb2 as pb
from paramshard.server.buffers.slice_state import SliceState, master_dtype
from paramshard.server.optimizers import OptimizerError, make_optimizer
from paramshard.server.runtime import backend
from paramshard.server.runtime.errors import ShardError
from paramshard.server.snapshots.shards import Captured

__all__ = ["Captures"]


class Captures(SliceState):
    """Snapshot captures and restores of one slice."""

    def request_capture(self, version: int) -> None:
        """Asks for a copy at ``version`` (taken just before the step that would leave it).
        Requests are counted: each is ended by one ``release_capture``, and the copy stays
        until every request for its version has ended (two snapshots may wait for one
        version: the first to end used to take the other's request, and the other failed)."""
        with self.cond:
            if self.version > version and version not in self.captures:
                raise ShardError.precondition(
                    f"{self.label} is at version {self.version}, past the snapshot's {version}"
                )
            self.capture_requests[version] += 1

    def release_capture(self, version: int) -> None:
        """Ends one ``request_capture`` of ``version``; the copy goes with the last one."""
        with self.cond:
            self.capture_requests[version] -= 1
            if self.capture_requests[version] <= 0:
                del self.capture_requests[version]
                self.captures.pop(version, None)

    def capture_bytes(self) -> int:
        """What a capture copies: params and the optimizer's state arrays (those it has now;
        a capture is taken before the next step makes any other)."""
        return int(self.master.nbytes) + self.optimizer.state_bytes()

    def capture(self, version: int, timeout: float) -> Captured:
        """Host copies of params and optimizer state at exactly ``version``: now if the slice
        is there, else when it gets there (just before the next step), without stopping it;
        a caller that went away ends the wait (``wait_for``). The copy is shared with other
        calls that capture the same version (it is never written)."""
        self.request_capture(version)
        try:
            with self.cond:
                self.wait_for(
                    lambda: version in self.captures or self.version >= version,
                    timeout,
                    f"version {version} to snapshot it",
                )
                if version not in self.captures:
                    if self.version != version:  # SetParams/restore jumped past it
                        raise ShardError.precondition(
                            f"{self.label} moved from before version {version} to version"
                            f" {self.version} without stepping through it; snapshot again"
                        )
                    self._capture()
                return self.captures[version]
        finally:
            self.release_capture(version)

    def _capture(self) -> None:
        """Caller holds the lock."""
        self.captures[self.version] = self.copy_state()

    def copy_state(self) -> Captured:
        """Host copies of params and optimizer state as they are now (caller holds the lock)."""
        state = {k: backend.to_host(v).copy() for k, v in self.optimizer.state_arrays().items()}
        return Captured(
            self.name,
            self.start,
            backend.to_host(self.master).copy(),
            state,
            self.optimizer.step_count,
        )

    @classmethod
    def restored(
        cls,
        req: pb.RegisterBufferRequest,
        version: int,
        params: Any,
        state: dict[str, Any],
        step_count: int,
    ) -> Any:
        """A slice rebuilt from a snapshot (the store swaps it in)."""
        try:
            optimizer = make_optimizer(
                req.optimizer.name, len(params), dict(req.optimizer.hyper), master_dtype(req)
            )
            optimizer.load_state(state, step_count)
        except OptimizerError as exc:
            raise ShardError.precondition(
                f"buffer '{req.ref.job}/{req.ref.buffer}': {exc}"
            ) from None
        b = cls(req, optimizer)
        b.master[...] = backend.to_device(params)
        b.version = version
        b.initialized = True
        return b
