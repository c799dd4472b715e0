"""Flat-buffer slices: master params, gradient accumulation, versions, optimizer steps.

Wire semantics (DESIGN section 3):
- A slice's *version* counts optimizer steps applied. Gradient pushes for step s are accepted
  only while the version is s; pushes for an already applied step are acknowledged as duplicates.
- A *contribution* is (step, contributor, micro-batch, chunk offset) and is added exactly once,
  so a client may retry any push.
- When contributors x micro-batches contributions have covered the whole slice, the gradient is
  *reduced*: micro-batches summed, contributors averaged (what DDP does). Unless the buffer was
  registered with ``arrival_order``, the sum runs in (contributor, micro-batch) order whatever
  order the pushes arrive in: a contribution whose predecessors are all in is added at once,
  any other waits in staging memory until they are (``PendingStep``), so two runs of the same
  training are bitwise identical, as with torch's gloo collectives. The optimizer then
  runs either at once (the pushes carried step arguments) or when a Step request arrives
  (global gradient clipping needs the norm first).
- A reduced gradient holding NaN or Inf is never applied: GradNorm reports each slice's
  finiteness, the client sends every server the same Step, applied or skipped (a skipped step
  leaves params and optimizer state as they were and still moves the version on); see
  server/nonfinite.py.
- The master copy, the accumulator and the optimizer state are float64 for a buffer registered
  with ``master_dtype=FLOAT64`` (a float64 model), float32 otherwise (DESIGN section 3).
Every check happens before any state changes, so a rejected request leaves the slice as it was.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protos import shard_pb2 as pb
from protos import slicing
from protos.manifest import check_model_config
from server import arrays, backend
from server.errors import ShardError
from server.limits import MemoryBudget, slice_bytes
from server.nonfinite import all_finite, nonfinite_refusal
from server.optimizers import OptimizerError, ServerOptimizer, make_optimizer
from server.snapshots import Captured

__all__ = ["BufferSlice", "BufferStore", "master_dtype"]

_MASTER_DTYPES = (pb.DTYPE_UNSPECIFIED, pb.FLOAT32, pb.FLOAT64)


def master_dtype(req: pb.RegisterBufferRequest) -> str:
    """The master dtype a registration asks for: float64 for float64 models, else float32."""
    return "float64" if req.master_dtype == pb.FLOAT64 else "float32"


@dataclass
class PendingStep:
    """Gradient contributions of the step being accumulated.

    Rank-order reduction: contribution k = contributor * num_micro + micro is added to the
    accumulator only after contributions 0..k-1 are complete, so every element sees the same
    sequence of additions whatever the arrival order. ``head`` is the first incomplete one;
    chunks of later ones wait in ``staged`` (copies) until ``head`` reaches them.
    """

    step: int
    num_micro: int
    chunks: dict[int, slicing.Coverage] = field(default_factory=dict)  # per contribution k
    reduced: bool = False
    sum_squares: float | None = None
    param_sum_squares: list[float] | None = None
    finite: bool | None = None  # the reduced gradient holds no NaN or Inf (computed once)
    head: int = 0
    staged: dict[int, list[tuple[int, Any]]] = field(default_factory=dict)
    staged_bytes: int = 0
    opened: float = field(default_factory=time.monotonic)  # for Status (server/pending.py)

    def received(self, k: int) -> int:
        """Elements of contribution ``k`` received so far."""
        chunks = self.chunks.get(k)
        return chunks.covered if chunks is not None else 0


class BufferSlice:
    """Slice ``index`` of one job's flat buffer, with its optimizer."""

    def __init__(self, req: pb.RegisterBufferRequest, optimizer: ServerOptimizer) -> None:
        self.job, self.name = req.ref.job, req.ref.buffer
        self.label = f"buffer '{self.job}/{self.name}'"
        self.spec = req
        self.numel = req.numel
        self.start, stop = slicing.slice_bounds(req.numel, req.num_servers, req.server_index)
        self.slice_numel = stop - self.start
        self.contributors = req.contributors
        self.optimizer = optimizer
        self.dtype = optimizer.dtype  # float32, or float64 for a float64 model
        self.arrival_order = req.arrival_order
        self.master = backend.xp.zeros(self.slice_numel, dtype=self.dtype)
        self.grad: Any = None  # accumulator (master dtype), allocated at the first push
        self.version = 0
        self.written = slicing.Coverage()  # SetParams chunks of the current version
        self.initialized = self.slice_numel == 0
        self.pending: PendingStep | None = None
        self.applied_sum_squares: tuple[int, float] | None = None  # (step, value) last applied
        self.applied_param_sum_squares: tuple[int, list[float]] | None = None
        self.applied_finite: tuple[int, bool] | None = None
        self.skipped_steps = 0  # steps discarded because their reduced gradient was not finite
        # Each registered parameter's elements inside this slice, as local [lo, hi) ranges.
        self.param_ranges = [
            (
                min(max(p.offset - self.start, 0), self.slice_numel),
                min(max(p.offset + p.numel - self.start, 0), self.slice_numel),
            )
            for p in req.params
        ]
        self.last_step_seconds = 0.0
        self.last_step_unix = 0.0
        self.dropped = False
        self.budget, self.reserved = MemoryBudget(), 0  # the store's, once it holds the slice
        self.replicator: Any = None  # server.replication.Replicator when the job replicates
        self.capture_requests: set[int] = set()  # versions a snapshot waits to capture
        self.captures: dict[int, Captured] = {}
        self.cond = threading.Condition()

    # -- helpers ---------------------------------------------------------------------------
    def check_chunk(self, chunk: pb.Chunk, what: str) -> None:
        if chunk.offset + chunk.numel > self.slice_numel:
            raise ShardError.invalid(
                f"{self.label}: {what} chunk [{chunk.offset:,}, {chunk.offset + chunk.numel:,})"
                f" is outside this server's slice of {self.slice_numel:,} elements"
            )
        if chunk.dtype not in arrays.FLOAT_WIRE:
            raise ShardError.invalid(
                f"{self.label}: {what} dtype must be float32, float16, bfloat16 or float64,"
                f" got wire dtype {chunk.dtype}"
            )

    def wait_for(self, ready: Any, timeout: float, waiting_for: str) -> None:
        """Wait on the slice's condition (caller holds it) until ``ready()``, or fail."""
        done = self.cond.wait_for(lambda: self.dropped or ready(), timeout=timeout)
        if self.dropped:
            raise ShardError.not_found(f"{self.label} was dropped while waiting for {waiting_for}")
        if not done:
            raise ShardError.deadline(
                f"{self.label} is at version {self.version};"
                f" waited {timeout:.1f} s for {waiting_for}"
            )

    def retire(self) -> None:
        """The slice left the store (dropped, replaced): waiters wake and fail, memory is freed."""
        with self.cond:
            if not self.dropped:
                self.dropped = True
                self.budget.release(self.reserved, "buffers")
                self.budget.release(self.pending.staged_bytes if self.pending else 0, "staging")
                self.cond.notify_all()

    def bytes_by_kind(self) -> tuple[int, int, int]:
        """(params, gradients: accumulator and staged contributions, optimizer state)."""
        grad = 0 if self.grad is None else int(self.grad.nbytes)
        grad += self.pending.staged_bytes if self.pending is not None else 0
        return int(self.master.nbytes), grad, int(self.optimizer.state_bytes())

    # -- requests --------------------------------------------------------------------------
    def set_params(self, header: pb.SetParamsHeader, data: memoryview) -> bool:
        self.check_chunk(header.chunk, "SetParams")
        host = arrays.payload_array(data, header.chunk.dtype, header.chunk.numel, self.label)
        if header.state:
            return self._set_state(header, host)
        with self.cond:
            if header.version != self.version:
                # A new version of the values (restore): start counting coverage again.
                self.written = slicing.Coverage()
                self.initialized = self.slice_numel == 0
                self.version = header.version
                self.budget.release(self.pending.staged_bytes if self.pending else 0, "staging")
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

    def push_grad(self, h: pb.PushGradHeader, data: memoryview, timeout: float) -> pb.PushGradReply:
        self.check_chunk(h.chunk, "PushGrad")
        host = arrays.payload_array(data, h.chunk.dtype, h.chunk.numel, self.label)
        if h.num_micro == 0 or h.micro >= h.num_micro:
            raise ShardError.invalid(
                f"{self.label}: micro-batch {h.micro} of num_micro={h.num_micro} is out of range"
            )
        if h.contributor >= self.contributors:
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
            pending = self.pending or PendingStep(h.step, h.num_micro)
            if pending.num_micro != h.num_micro:
                raise ShardError.precondition(
                    f"{self.label}: step {h.step} accumulates {pending.num_micro} micro-batches"
                    f" per contributor, this push says {h.num_micro}"
                )
            o, n = h.chunk.offset, h.chunk.numel
            k = h.contributor * pending.num_micro + h.micro  # its place in the rank order
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
            if self._stages(pending, k):  # its copy waits for its turn: paid for first
                self.budget.reserve(n * self.dtype.itemsize, "staging", self.label)
            # -- all checks passed: mutate --
            if self.grad is None:
                self.grad = backend.xp.zeros(self.slice_numel, dtype=self.dtype)
            if not pending.chunks:
                self.grad.fill(0)
            pending.chunks[k] = chunks
            chunks.add(o, n)
            self._accumulate(pending, k, o, arrays.to_compute(host, h.chunk.dtype))
            self.pending = pending
            if pending.head == self.contributors * pending.num_micro:  # every one complete
                assert not pending.staged, "every contribution is complete, none may wait"
                if self.contributors > 1:
                    self.grad /= self.dtype.type(self.contributors)
                pending.reduced = True
                if h.HasField("step_args") and self._finite():  # else a Step decides
                    self._apply_step(h.step_args)
                self.cond.notify_all()
            return pb.PushGradReply(reduced=pending.reduced, version=self.version)

    def _accumulate(self, pending: PendingStep, k: int, o: int, values: Any) -> None:
        """Adds contribution ``k``'s chunk at ``o`` (already recorded in ``pending.chunks``) in
        rank order, or at once with ``arrival_order``; moves ``head`` past what is complete."""
        last = self.contributors * pending.num_micro
        if not self._stages(pending, k):
            self.grad[o : o + values.size] += values
        else:
            kept = values.copy()  # ``values`` may be a view of the request's bytes
            pending.staged.setdefault(k, []).append((o, kept))
            pending.staged_bytes += int(kept.nbytes)
        while pending.head < last and pending.received(pending.head) >= self.slice_numel:
            pending.head += 1
            for lo, kept in pending.staged.pop(pending.head, ()):
                self.grad[lo : lo + kept.size] += kept
                pending.staged_bytes -= int(kept.nbytes)
                self.budget.release(kept.nbytes, "staging")

    def _stages(self, pending: PendingStep, k: int) -> bool:
        """Whether contribution ``k`` must wait in staging for its turn in the rank order.
        With two contributions there is nothing to order: 0 + a + b == 0 + b + a exactly."""
        last = self.contributors * pending.num_micro
        return not (self.arrival_order or k == pending.head or last <= 2)

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

    def sum_squares(self, step: int, timeout: float) -> float:
        """This slice's sum of squares of the reduced gradient of ``step``."""
        return self._norm_of(step, timeout, "applied_sum_squares", self._sum_squares)

    def param_sum_squares(self, step: int, timeout: float) -> list[float]:
        """The same, one value per registered parameter (its elements in this slice)."""
        return self._norm_of(step, timeout, "applied_param_sum_squares", self._param_sum_squares)

    def finite(self, step: int, timeout: float) -> bool:
        """Whether this slice's reduced gradient of ``step`` holds no NaN or Inf."""
        return self._norm_of(step, timeout, "applied_finite", self._finite)

    def _norm_of(self, step: int, timeout: float, kept_attr: str, compute: Any) -> Any:
        """``compute()`` of the reduced gradient of ``step``, waiting for it, or the value
        kept when the step was applied (a faster rank already stepped)."""
        with self.cond:
            if step < self.version:
                kept = getattr(self, kept_attr)
                if kept is not None and kept[0] == step:
                    return kept[1]
                raise ShardError.precondition(
                    f"{self.label}: step {step} is already applied (version {self.version});"
                    " its gradient is gone"
                )
            self.wait_for(
                lambda: self.version > step or self._reduced(step),
                timeout,
                f"the reduced gradient of step {step}",
            )
            if self.version > step:
                kept = getattr(self, kept_attr)
                if kept is None or kept[0] != step:
                    raise ShardError.precondition(
                        f"{self.label} moved to version {self.version} while waiting; the"
                        f" gradient of step {step} is gone"
                    )
                return kept[1]
            return compute()

    def _reduced(self, step: int) -> bool:
        """All contributions of ``step`` are in. An empty slice (a buffer with fewer elements
        than servers) receives no pushes, so it is reduced whenever it is asked."""
        if self.slice_numel == 0:
            return self.version == step
        return self.pending is not None and self.pending.step == step and self.pending.reduced

    def _sum_squares(self) -> float:
        """Of the pending reduced gradient (caller holds the lock)."""
        if self.slice_numel == 0:
            return 0.0
        pending = self.pending
        assert pending is not None and pending.reduced
        if pending.sum_squares is None:
            g = self.grad
            pending.sum_squares = float(backend.xp.dot(g, g)) if self.slice_numel else 0.0
        return pending.sum_squares

    def _param_sum_squares(self) -> list[float]:
        """Per registered parameter, of the pending reduced gradient (caller holds the lock)."""
        if self.slice_numel == 0:
            return [0.0] * len(self.param_ranges)
        pending = self.pending
        assert pending is not None and pending.reduced
        if pending.param_sum_squares is None:
            g = self.grad
            pending.param_sum_squares = [
                float(backend.xp.dot(g[lo:hi], g[lo:hi])) if hi > lo else 0.0
                for lo, hi in self.param_ranges
            ]
        return pending.param_sum_squares

    def _finite(self) -> bool:
        """Of the pending reduced gradient (caller holds the lock)."""
        if self.slice_numel == 0:
            return True
        pending = self.pending
        assert pending is not None and pending.reduced
        if pending.finite is None:
            pending.finite = all_finite(self.grad, self._sum_squares())
        return pending.finite

    def step(self, step: int, args: pb.StepArgs, timeout: float, skip: bool = False) -> int:
        """Applies step ``step`` (``skip``: discards its gradient and moves the version on)."""
        self.check_step_args(args)
        with self.cond:
            if step < self.version:
                return self.version  # applied already: the first request won
            if step > self.version:
                raise ShardError.precondition(
                    f"{self.label} is at version {self.version}; cannot apply step {step}"
                )
            self.wait_for(
                lambda: self.version > step or self._reduced(step),
                timeout,
                f"all gradient contributions of step {step}",
            )
            if self.version == step:
                if not skip and not self._finite():
                    raise ShardError.precondition(nonfinite_refusal(self.label, step))
                self._apply_step(args, skip)
                self.cond.notify_all()
            return self.version

    # -- snapshots ------------------------------------------------------------------------------
    def request_capture(self, version: int) -> None:
        """Asks for a copy at ``version`` (taken just before the step that would leave it)."""
        with self.cond:
            if self.version > version:
                raise ShardError.precondition(
                    f"{self.label} is at version {self.version}, past the snapshot's {version}"
                )
            self.capture_requests.add(version)

    def cancel_capture(self, version: int) -> None:
        with self.cond:
            self.capture_requests.discard(version)
            self.captures.pop(version, None)

    def capture(self, version: int, timeout: float) -> Captured:
        """Host copies of params and optimizer state at exactly ``version``: now if the slice
        is there, else when it gets there (just before the next step), without stopping it."""
        self.request_capture(version)
        with self.cond:
            try:
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
                return self.captures.pop(version)
            finally:
                self.capture_requests.discard(version)

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
    ) -> BufferSlice:
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

    # -- the optimizer step ----------------------------------------------------------------
    def check_step_args(self, args: pb.StepArgs) -> None:
        try:
            self.optimizer.check_hyper(dict(args.hyper))
        except OptimizerError as exc:
            raise ShardError.invalid(f"{self.label}: {exc}") from None
        if not np.isfinite(args.clip_coef) or args.clip_coef < 0:
            raise ShardError.invalid(f"{self.label}: clip_coef must be >= 0, got {args.clip_coef}")

    def _apply_step(self, args: pb.StepArgs, skip: bool = False) -> None:
        """Caller holds the lock and has checked ``args``. ``skip``: the gradient is discarded,
        params and optimizer state stay as they are, only the version moves on."""
        if self.version in self.capture_requests and self.version not in self.captures:
            self._capture()  # a snapshot wants the state before this step
        began = time.perf_counter()
        # kept for ranks that ask for this step's norm after a faster rank stepped
        self.applied_sum_squares = (self.version, self._sum_squares())
        self.applied_param_sum_squares = (self.version, self._param_sum_squares())
        self.applied_finite = (self.version, self._finite())
        if skip:
            self.skipped_steps += 1
        else:
            self.optimizer.update_hyper(dict(args.hyper))
            if args.clip_coef and args.clip_coef != 1.0:
                self.grad *= self.dtype.type(args.clip_coef)
            if self.slice_numel:
                self.optimizer.step(self.master, self.grad)
        self.version += 1
        self.pending = None
        self.last_step_seconds = time.perf_counter() - began
        self.last_step_unix = time.time()
        if self.replicator is not None:
            self.replicator.on_version(self)


class BufferStore:
    """All buffers of all jobs on this server."""

    def __init__(self, max_job_bytes: int = 0, budget: MemoryBudget | None = None) -> None:
        self.max_job_bytes = max_job_bytes  # 0: unbounded
        self.budget = budget or MemoryBudget()  # the server's memory, shared with slots etc.
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[str, BufferSlice]] = {}

    def get(self, job: str, buffer: str) -> BufferSlice:
        with self._lock:
            buffers = self._jobs.get(job)
            if buffers is None:
                known = ", ".join(sorted(self._jobs)) or "none"
                raise ShardError.not_found(f"job '{job}' is not on this server (jobs: {known})")
            found = buffers.get(buffer)
        if found is None:
            raise ShardError.not_found(f"job '{job}' has no buffer '{buffer}'")
        return found

    def jobs(self) -> dict[str, list[BufferSlice]]:
        with self._lock:
            return {job: list(b.values()) for job, b in self._jobs.items()}

    def register(self, req: pb.RegisterBufferRequest) -> BufferSlice:
        label = f"buffer '{req.ref.job}/{req.ref.buffer}'"
        if not req.ref.job or not req.ref.buffer:
            raise ShardError.invalid("RegisterBuffer needs a job name and a buffer name")
        if req.num_servers == 0 or req.server_index >= req.num_servers:
            raise ShardError.invalid(
                f"{label}: server_index {req.server_index} is outside 0..{req.num_servers - 1}"
            )
        if req.contributors == 0:
            raise ShardError.invalid(f"{label}: contributors must be at least 1")
        if req.master_dtype not in _MASTER_DTYPES:
            raise ShardError.invalid(
                f"{label}: master_dtype must be FLOAT32 or FLOAT64 (for float64 models),"
                f" got DType value {req.master_dtype}"
            )
        if req.model_config:
            try:
                check_model_config(req.model_config)
            except ValueError as exc:
                raise ShardError.invalid(f"{label}: {exc}") from None
        for p in req.params:
            if (
                any(d < 0 for d in p.shape)
                or p.offset + p.numel > req.numel
                or math.prod(p.shape) != p.numel  # Python ints: no int64 overflow to 0
            ):
                raise ShardError.invalid(
                    f"{label}: parameter '{p.name}' (shape {list(p.shape)}, offset {p.offset:,})"
                    f" does not fit a buffer of {req.numel:,} elements"
                )
            if p.split_parts > 1 and (
                p.split_index >= p.split_parts or p.split_dim >= len(p.shape)
            ):
                raise ShardError.invalid(
                    f"{label}: parameter '{p.name}' is part {p.split_index} of {p.split_parts}"
                    f" along dim {p.split_dim} in {p.split_packed} packed blocks, which does not"
                    f" fit its shape {list(p.shape)}"
                )
        with self._lock:
            existing = self._fitting(req, label)
        if existing is not None:
            return existing
        need = slice_bytes(req)
        self.budget.reserve(need, "buffers", label)  # before anything is allocated
        try:
            created = self._create(req, label)
            with self._lock:  # again: another call may have registered meanwhile
                existing = self._fitting(req, label)
                if existing is None:
                    created.budget, created.reserved = self.budget, need
                    self._jobs.setdefault(req.ref.job, {})[req.ref.buffer] = created
                    return created
        except BaseException:
            self.budget.release(need, "buffers")
            raise
        self.budget.release(need, "buffers")
        return existing

    def _create(self, req: pb.RegisterBufferRequest, label: str) -> BufferSlice:
        start, stop = slicing.slice_bounds(req.numel, req.num_servers, req.server_index)
        slice_numel = stop - start
        try:
            optimizer = make_optimizer(
                req.optimizer.name, slice_numel, dict(req.optimizer.hyper), master_dtype(req)
            )
        except OptimizerError as exc:
            raise ShardError.invalid(f"{label}: {exc}") from None
        except (MemoryError, ValueError) as exc:
            raise ShardError.exhausted(
                f"{label}: cannot allocate optimizer state for {slice_numel:,} elements ({exc})"
            ) from None
        if self.max_job_bytes:
            # params + grad accumulator + up to three optimizer-state arrays, master dtype
            need = slice_numel * optimizer.dtype.itemsize * 5 + self._job_bytes(req.ref.job)
            if need > self.max_job_bytes:
                raise ShardError.exhausted(
                    f"{label}: job '{req.ref.job}' would need about {need:,} bytes on this server,"
                    f" over its quota of {self.max_job_bytes:,}"
                )
        try:
            return BufferSlice(req, optimizer)
        except (MemoryError, ValueError) as exc:
            raise ShardError.exhausted(
                f"{label}: cannot allocate {slice_numel * optimizer.dtype.itemsize:,} bytes of"
                f" parameters ({exc})"
            ) from None

    def _fitting(self, req: pb.RegisterBufferRequest, label: str) -> BufferSlice | None:
        """The buffer ``req`` registers again, None if it is new; FAILED_PRECONDITION when it
        does not fit what the job holds here: every buffer of a job is the same slice of the
        same number of servers (its placement), and a buffer keeps its layout. Called under
        the store's lock."""
        siblings = self._jobs.get(req.ref.job, {})
        other = next(iter(siblings.values()), None)
        if other is not None and (other.spec.server_index, other.spec.num_servers) != (
            req.server_index,
            req.num_servers,
        ):
            raise ShardError.precondition(
                f"{label}: job '{req.ref.job}' is on this server as slice"
                f" {other.spec.server_index} of {other.spec.num_servers}, this buffer says"
                f" {req.server_index} of {req.num_servers}: every buffer of a job has the same"
                " servers"
            )
        existing = siblings.get(req.ref.buffer)
        if existing is None:
            return None
        old = existing.spec
        same = (
            old.numel == req.numel
            and old.num_servers == req.num_servers
            and old.server_index == req.server_index
            and old.contributors == req.contributors
            and list(old.params) == list(req.params)
            and old.optimizer.name == req.optimizer.name
            and master_dtype(old) == master_dtype(req)
            and old.arrival_order == req.arrival_order
        )
        if not same:
            raise ShardError.precondition(
                f"{label} exists with another layout (numel {old.numel:,} over"
                f" {old.num_servers} servers, {old.contributors} contributors, optimizer"
                f" '{old.optimizer.name}', {master_dtype(old)} master,"
                f" {'arrival' if old.arrival_order else 'rank'}-order sums); drop the job first"
            )
        return existing

    def _job_bytes(self, job: str) -> int:
        with self._lock:
            buffers = list(self._jobs.get(job, {}).values())
        return sum(sum(b.bytes_by_kind()) for b in buffers)

    def replace_job(self, job: str, slices: list[BufferSlice]) -> None:
        """Swaps a job's buffers for restored ones in one go; waiters on the old ones wake."""
        need = [slice_bytes(b.spec) for b in slices]
        self.budget.reserve(sum(need), "buffers", f"restore of job '{job}'")
        for b, n in zip(slices, need, strict=True):
            b.budget, b.reserved = self.budget, n
        with self._lock:
            old = self._jobs.pop(job, {})
            self._jobs[job] = {b.name: b for b in slices}
        for b in old.values():
            b.retire()

    def drop(self, job: str) -> int:
        with self._lock:
            dropped = self._jobs.pop(job, None)
        if dropped is None:
            raise ShardError.not_found(f"job '{job}' is not on this server")
        for b in dropped.values():  # waiters fail fast; pending contributions go with them
            b.retire()
        return len(dropped)

    def status(self) -> list[pb.JobStatus]:
        from server.status import job_status  # it reads the store: imported on use

        return job_status(self)
