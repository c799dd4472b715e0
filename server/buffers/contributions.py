"""A slice's contributions: SetParams chunks, gradient pushes added exactly once in rank order
(staged until their turn), and pulls that wait for a version (the wire semantics:
server/buffers/slice_state.py)."""

from __future__ import annotations

import time
from typing import Any

from paramshard.protos import shard_pb2 as pb
from paramshard.protos import slicing
from paramshard.server.buffers.membership import check_membership, elastic_pending
from paramshard.server.buffers.slice_state import STAGED_RECORD_BYTES, PendingStep, SliceState
from paramshard.server.optimizers import OptimizerError
from paramshard.server.runtime import arrays, backend
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.request_bounds import check_version
from paramshard.server.runtime.turns import TurnWaits

__all__ = ["Contributions"]


class Contributions(SliceState):
    """SetParams, PushGrad and PullParams of one slice."""

    def set_params(self, header: pb.SetParamsHeader, data: memoryview) -> bool:
        check_version(header.version, "version", f"{self.label}: SetParams")
        check_version(header.optimizer_steps, "optimizer_steps", f"{self.label}: SetParams")
        self.check_chunk(header.chunk, "SetParams")
        host = arrays.payload_array(data, header.chunk.dtype, header.chunk.numel, self.label)
        if header.state:
            return self._set_state(header, host)
        with self.cond:
            self._check_held("SetParams")
            if header.version != self.version:
                # A new version of the values (restore): start counting coverage again.
                self.written = slicing.Coverage()
                self.initialized = self.slice_numel == 0
                self.version = header.version
                self.budget.release(self.pending.staged_charge if self.pending else 0, "staging")
                self.pending = None
            o, n = header.chunk.offset, header.chunk.numel
            retry = self.written.numel_at(o) == n  # a chunk written before, written again
            clash = None if retry else self.written.clash(o, n)
            if clash is not None:
                raise ShardError.invalid(
                    f"{self.label}: SetParams chunk [{o:,}, {o + n:,}) overlaps chunk"
                    f" [{clash[0]:,}, {clash[1]:,}) written for version {self.version};"
                    " chunks must cover the slice exactly once"
                )
            arrays.to_compute(host, header.chunk.dtype, into=self.master[o : o + n])
            if not retry:
                self.written.add(o, n)
            if self.written.covered >= self.slice_numel:
                self.initialized = True
            self.cond.notify_all()
            return self.initialized

    def _set_state(self, header: pb.SetParamsHeader, host: Any) -> bool:
        """SetParams into an optimizer state array (at the current version only)."""
        with self.cond:
            self._check_held("SetParams")
            if header.version != self.version:
                raise ShardError.precondition(
                    f"{self.label} is at version {self.version}; optimizer state for version"
                    f" {header.version} cannot be written"
                )
            values = arrays.to_compute(host, header.chunk.dtype)
            try:
                self.optimizer.write_state(
                    header.state, header.chunk.offset, values, header.optimizer_steps
                )
            except OptimizerError as exc:
                raise ShardError.invalid(f"{self.label}: {exc}") from None
            return self.initialized

    def _check_held(self, method: str) -> None:
        """The slice is still the store's (caller holds the lock). A call looks its slice up
        before it takes the lock; one that a DropJob or a restore retired meanwhile changes
        nothing (the calls that wait check in ``wait_for``). Before, a SetParams of a new
        version there released the staging that ``retire`` had released already, and the
        account went below zero, every later release failing."""
        if self.dropped:
            raise ShardError.not_found(
                f"{method}: {self.label} was dropped or replaced (DropJob, or a restore) as the"
                " call began"
            )

    def push_grad(
        self, h: pb.PushGradHeader, data: memoryview, timeout: float, turn_until: float = 0.0
    ) -> pb.PushGradReply:
        """Adds a chunk of a contribution; one that came before its turn waits for it first,
        until ``turn_until`` (``_wait_turn``), then is staged as a copy."""
        deadline, turn_until = time.monotonic() + timeout, turn_until or TurnWaits.until(timeout)
        self.check_chunk(h.chunk, "PushGrad")
        host = arrays.payload_array(data, h.chunk.dtype, h.chunk.numel, self.label)
        if h.num_micro == 0 or h.micro >= h.num_micro:
            raise ShardError.invalid(
                f"{self.label}: micro-batch {h.micro} of num_micro={h.num_micro} is out of range"
            )
        key = b""
        if h.HasField("membership"):
            key = check_membership(self.label, self.contributors, h, self.pending)
        elif h.contributor >= self.contributors:
            raise ShardError.invalid(
                f"{self.label}: contributor {h.contributor} is outside 0..{self.contributors - 1}"
            )
        with self.cond:
            if h.step < self.version:
                return pb.PushGradReply(duplicate=True, reduced=True, version=self.version)
            if h.step > self.version:
                raise ShardError.precondition(
                    f"{self.label} is at version {self.version}; cannot take gradients of step"
                    f" {h.step} before step {self.version} is applied"
                )
            # Another rank may still be writing the initial values: wait for them, bounded.
            self.wait_for(lambda: self.initialized, timeout, "its initial parameters (SetParams)")
            if h.step != self.version:
                raise ShardError.precondition(
                    f"{self.label} moved to version {self.version} while step {h.step} waited"
                )
            pending, replaces = self._pending_for(h, key)
            if pending.num_micro != h.num_micro:
                raise ShardError.precondition(
                    f"{self.label}: step {h.step} accumulates {pending.num_micro} micro-batches"
                    f" per contributor, this push says {h.num_micro}"
                )
            o, n = h.chunk.offset, h.chunk.numel
            k = self._place(pending, h)  # its place in the rank order
            chunks = pending.chunks.get(k, slicing.Coverage())
            before = chunks.numel_at(o)
            if before is not None:
                if before != n:
                    key = (h.contributor, h.micro, o)
                    raise ShardError.invalid(
                        f"{self.label}: contribution {key} was {before:,} elements,"
                        f" the retry has {n:,}"
                    )
                return pb.PushGradReply(
                    duplicate=True, reduced=pending.reduced, version=self.version
                )
            clash = chunks.clash(o, n)
            if clash is not None:
                raise ShardError.invalid(
                    f"{self.label}: step {h.step}, contributor {h.contributor}, micro-batch"
                    f" {h.micro}: chunk [{o:,}, {o + n:,}) overlaps chunk"
                    f" [{clash[0]:,}, {clash[1]:,}) pushed before; chunks must cover the slice"
                    " exactly once"
                )
            if h.HasField("step_args"):
                self.check_step_args(h.step_args)
            stages = self._stages(pending, k, o, n)
            if stages and self._wait_turn(pending, k, o, n, h.step, turn_until):
                return self.push_grad(h, data, deadline - time.monotonic(), turn_until)
            if stages:  # its copy waits for its turn: paid for first
                need = n * self.dtype.itemsize + STAGED_RECORD_BYTES
                self.budget.reserve(need, "staging", self.label)
            # -- all checks passed: mutate --
            if replaces:  # a newer membership generation: the older one's sums are void
                self.budget.release(self.pending.staged_charge, "staging")
                self.cond.notify_all()  # its GradNorms and Steps end (membership.py)
            if self.grad is None:  # (no zeros for a new step: its first additions copy)
                self.grad = backend.xp.zeros(self.slice_numel, dtype=self.dtype)
            pending.chunks[k] = chunks
            chunks.add(o, n)
            self._accumulate(pending, k, o, arrays.to_compute(host, h.chunk.dtype))
            self.pending = pending
            if pending.head == self._last(pending):  # every one complete
                assert not pending.staged, "every contribution is complete, none may wait"
                if pending.weights is None and self.contributors > 1:
                    self.grad /= self.dtype.type(self.contributors)
                pending.reduced = True
                if h.HasField("step_args") and self._finite():  # else a Step decides
                    self._apply_step(h.step_args)
                self.cond.notify_all()
            return pb.PushGradReply(reduced=pending.reduced, version=self.version)

    def _pending_for(self, h: pb.PushGradHeader, key: bytes) -> tuple[PendingStep, bool]:
        """The pending step push ``h`` adds to, and whether it replaces the current one (an
        elastic step's older membership generation). Checks only."""
        if h.HasField("membership"):
            return elastic_pending(self.label, self.pending, h, key)
        if self.pending is not None and self.pending.members is not None:
            raise ShardError.precondition(
                f"{self.label}: step {h.step} accumulates the pushes of an elastic membership;"
                f" a push of rank {h.contributor} without one cannot join it"
            )
        return self.pending or PendingStep(h.step, h.num_micro), False

    @staticmethod
    def _place(pending: PendingStep, h: pb.PushGradHeader) -> int:
        """Contribution k of push ``h``: its place in the rank order."""
        i = h.contributor if pending.positions is None else pending.positions[h.contributor]
        return i * pending.num_micro + h.micro

    def _last(self, pending: PendingStep) -> int:
        """How many contributions the step sums."""
        return pending.count or self.contributors * pending.num_micro

    def _accumulate(self, pending: PendingStep, k: int, o: int, values: Any) -> None:
        """Adds contribution ``k``'s chunk at ``o`` (already recorded in ``pending.chunks``) in
        rank order over its elements, or at once with ``arrival_order``: a chunk whose
        elements have not taken contributions 0..k-1 yet waits as a copy in ``staged`` and is
        added (with the staged chunks it unblocks) when they have (``RankOrder``). Moves
        ``head`` past the contributions complete. An elastic step's contribution is weighted
        by its share as it is added."""
        if pending.weights is not None:
            values = values * self.dtype.type(pending.weights[k])  # a new array: may be kept
        if not self._ordered(pending):
            for a, b, taken in pending.order.runs(o, values.size):
                self._add(pending, taken, a, values[a - o : b - o])
        elif not self._stages(pending, k, o, values.size):
            self._add_in_order(pending, k, o, values)
            if self.turn_waiters:
                self.cond.notify_all()  # a push waiting for its turn may have it now
        else:
            kept = values.copy()  # ``values`` may be a view of the request's bytes
            pending.staged.setdefault(k, []).append((o, kept))
            pending.staged_bytes += int(kept.nbytes)
        last = self._last(pending)
        while pending.head < last and pending.received(pending.head) >= self.slice_numel:
            pending.head += 1

    def _add(self, pending: PendingStep, taken: int, o: int, values: Any) -> None:
        """Adds ``values`` at ``o``, where every element has taken ``taken`` contributions,
        and counts it (``pending.order``). An element's first contribution is copied: the
        slice is not zeroed before a step, so no pass over it is spent on zeros and no
        addition reads them."""
        part = self.grad[o : o + values.size]
        if taken == 0:
            part[...] = values
        else:
            part += values
        pending.order.advance(o, values.size)

    def _add_in_order(self, pending: PendingStep, k: int, o: int, values: Any) -> None:
        """Adds a ready chunk, then every staged chunk it makes ready, and theirs."""
        ready = [(k, o, values)]
        while ready:
            k, o, values = ready.pop()
            n = values.size
            self._add(pending, k, o, values)
            waiting = pending.staged.get(k + 1, [])
            for entry in [e for e in waiting if e[0] < o + n and o < e[0] + e[1].size]:
                lo, kept = entry
                if pending.order.ready(lo, kept.size, k + 1):
                    waiting.remove(entry)
                    pending.staged_bytes -= int(kept.nbytes)
                    self.budget.release(int(kept.nbytes) + STAGED_RECORD_BYTES, "staging")
                    ready.append((k + 1, lo, kept))
            if not waiting:
                pending.staged.pop(k + 1, None)

    def _wait_turn(
        self, pending: PendingStep, k: int, o: int, n: int, step: int, until: float
    ) -> bool:
        """Waits (the lock held) for chunk [o, o + n) of contribution ``k`` to have its turn,
        within the server's bounds (server/runtime/turns.py) and until ``until``; True when it
        waited and the push should look again (a slice dropped or stopped meanwhile fails
        it there), False when it is to be staged now: no wait was allowed, or the run's
        ranks disagree (``conflict``: contributions still count). A chunk that waits here is
        added from the request's own bytes (a shared segment or the message) when its turn
        comes, never copied: staged instead, early chunks held up to W - 1 slices of copies a
        server while the slowest rank caught up."""
        seen = self.pending
        done = lambda: (  # noqa: E731
            self.dropped
            or bool(self.stopped)
            or self.conflict is not None
            or self.version != step
            or (seen is not None and self.pending is not seen)
            or (self.pending is not None and self.pending.order.ready(o, n, k))
        )
        if not self.turns.wait(self.cond, done, n * self.dtype.itemsize, until, of=self):
            return False
        return self.conflict is None or self.dropped or bool(self.stopped)

    def _ordered(self, pending: PendingStep) -> bool:
        """Whether the step's sum keeps rank order. With two contributions there is nothing
        to order: 0 + a + b == 0 + b + a exactly."""
        return not self.arrival_order and self._last(pending) > 2

    def _stages(self, pending: PendingStep, k: int, o: int, n: int) -> bool:
        """Whether contribution ``k``'s chunk [o, o + n) must wait in staging for its turn."""
        return n > 0 and self._ordered(pending) and not pending.order.ready(o, n, k)

    def pull(
        self, req: pb.PullParamsRequest, timeout: float, encode: Any = None, on_device: bool = False
    ) -> Any:
        """(header, payload bytes), or ``encode(header, payload view)`` run under the lock (a
        later step rewrites master, so the one copy must be taken before it is released);
        ``on_device``: (header, a device array copy) for a caller in this process."""
        chunk = req.chunk
        self.check_chunk(chunk, "PullParams")
        with self.cond:
            self.wait_for(
                lambda: self.initialized and self.version >= req.min_version,
                timeout,
                f"version {req.min_version}",
            )
            o, n = chunk.offset, chunk.numel
            header = pb.PullParamsHeader(
                ref=req.ref,
                chunk=chunk,
                version=self.version,
                optimizer_steps=self.optimizer.step_count,
            )
            source = self.master
            if req.state:
                try:
                    source = self.optimizer.read_state(req.state)
                except OptimizerError as exc:
                    raise ShardError.precondition(f"{self.label}: {exc}") from None
            if on_device:
                return header, arrays.device_wire(source[o : o + n], chunk.dtype)
            if encode is not None:
                return encode(header, arrays.wire_array(source[o : o + n], chunk.dtype))
            payload = arrays.from_compute(source[o : o + n], chunk.dtype)
        return header, payload
