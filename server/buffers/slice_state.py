"""A flat-buffer slice's state: master params, accumulator, versions, pending step.

Wire semantics (docs/design.md §3):
- A slice's *version* counts optimizer steps applied. Gradient pushes for step s are accepted
  only while the version is s; pushes for an already applied step are acknowledged as duplicates.
- A *contribution* is (step, contributor, micro-batch, chunk offset) and is added exactly once,
  so a client may retry any push.
- When contributors x micro-batches contributions have covered the whole slice, the gradient is
  *reduced*: micro-batches summed, contributors averaged (what DDP does). A push of an elastic
  job names the step's members instead (``StepMembership``, server/buffers/membership.py):
  only they contribute, each weighted by its share of the global batch. Unless the buffer was
  registered with ``arrival_order``, the sum runs in (contributor, micro-batch) order whatever
  order the pushes arrive in: a chunk whose predecessors over its elements are in is added at
  once, any other waits for its turn (server/runtime/turns.py) or, past the bounds on that,
  in staging memory until they are (``PendingStep``), so two runs of the same training are
  bitwise identical, as with torch's gloo collectives. The optimizer then
  runs either at once (the pushes carried step arguments) or when a Step request arrives
  (global gradient clipping needs the norm first).
- A reduced gradient holding NaN or Inf is never applied: GradNorm reports each slice's
  finiteness, the client sends every server the same Step, applied or skipped (a skipped step
  leaves params and optimizer state as they were and still moves the version on); see
  server/buffers/nonfinite.py.
- The master copy, the accumulator and the optimizer state are float64 for a buffer registered
  with ``master_dtype=FLOAT64`` (a float64 model), float32 otherwise (docs/design.md §3.1).
Every check happens before any state changes, so a rejected request leaves the slice as it was.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from paramshard.protos import shard_pb2 as pb
from paramshard.protos import slicing
from paramshard.server.buffers.rank_order import RankOrder
from paramshard.server.optimizers import OPTIMIZERS, ServerOptimizer
from paramshard.server.runtime import arrays, backend
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.limits import MemoryBudget
from paramshard.server.runtime.rank_lists import absent, listed
from paramshard.server.runtime.run_names import NOTHING_KNOWN, RankNews, run_root, wait_asking
from paramshard.server.runtime.turns import TurnWaits
from paramshard.server.snapshots.shards import Captured

__all__ = [
    "MASTER_DTYPES",
    "PendingStep",
    "SLICE_RECORD_BYTES",
    "STAGED_RECORD_BYTES",
    "SliceState",
    "buffer_bytes",
    "master_dtype",
    "master_itemsize",
    "slice_bytes",
]

MASTER_DTYPES = (pb.DTYPE_UNSPECIFIED, pb.FLOAT32, pb.FLOAT64)


def master_dtype(req: pb.RegisterBufferRequest) -> str:
    """The master dtype a registration asks for: float64 for float64 models, else float32."""
    return "float64" if req.master_dtype == pb.FLOAT64 else "float32"


def master_itemsize(req: pb.RegisterBufferRequest) -> int:
    """Bytes an element of ``master_dtype(req)`` takes."""
    return 8 if req.master_dtype == pb.FLOAT64 else 4


STAGED_RECORD_BYTES = 1024
"""What a staged chunk's record costs beside its values, paid for with them (in review,
pushes of one element staged by the ten thousand were charged 4 bytes each). Measured with
CPython 3.11 for a chunk of one element: 328 bytes in the store (its array's header, its entry
in ``staged``, its coverage), 880 through a session (the process's resident memory a push)."""


@dataclass
class PendingStep:
    """Gradient contributions of the step being accumulated.

    Rank-order reduction: contribution k = contributor * num_micro + micro is added to an
    element of the accumulator only after contributions 0..k-1 were added there, so every
    element sees the same sequence of additions whatever the arrival order. ``order`` says
    how many each range has taken (server/buffers/rank_order.py); a chunk that came early
    waits in ``staged`` (a copy) until the chunks before it over its elements are in.
    ``head`` is the first contribution not yet received whole.
    """

    step: int
    num_micro: int
    members: tuple[int, ...] | None = None
    """Elastic jobs: the step's members (``StepMembership``), in rank order; contribution k is
    member ``members[k // num_micro]``'s. None: contributors 0..contributors-1."""
    generation: int = 0
    global_batch: int = 0
    membership_key: bytes = b""  # elastic jobs: the ``StepMembership`` as pushes encode it
    weights: Sequence[float] | None = None
    """Elastic jobs: contribution k is multiplied by ``weights[k]`` as it is added (its share
    of the global batch); None: contributions are summed, then averaged over contributors."""
    chunks: dict[int, slicing.Coverage] = field(default_factory=dict)  # per contribution k
    reduced: bool = False
    sum_squares: float | None = None
    param_sum_squares: list[float] | None = None
    finite: bool | None = None  # the reduced gradient holds no NaN or Inf (computed once)
    head: int = 0
    order: RankOrder = field(default_factory=RankOrder)
    staged: dict[int, list[tuple[int, Any]]] = field(default_factory=dict)
    staged_bytes: int = 0  # their values' bytes
    opened: float = field(
        default_factory=time.monotonic
    )  # for Status (server/collectives/pending.py)

    @property
    def staged_charge(self) -> int:
        """What the memory budget holds for the staged chunks: values and records."""
        return self.staged_bytes + STAGED_RECORD_BYTES * sum(map(len, self.staged.values()))

    @cached_property
    def positions(self) -> dict[int, int] | None:
        """Elastic jobs: member -> its index in ``members`` (None without members)."""
        return None if self.members is None else {r: i for i, r in enumerate(self.members)}

    @property
    def count(self) -> int:
        """Contributions the step waits for (with ``contributors`` of a job without members)."""
        return len(self.members) * self.num_micro if self.members is not None else 0

    def contributor_of(self, k: int) -> int:
        """The rank contribution ``k`` comes from."""
        i = k // self.num_micro
        return self.members[i] if self.members is not None else i

    def received(self, k: int) -> int:
        """Elements of contribution ``k`` received so far."""
        chunks = self.chunks.get(k)
        return chunks.covered if chunks is not None else 0

    def arrived(self, slice_numel: int) -> list[int]:
        """The contributors (ranks) whose every micro-batch covered the slice, in order: built
        from the pushes received, never from ``range(contributors)`` (up to 2**32 - 1); in an
        elastic step, position i is member ``members[i]``'s (``contributor_of``)."""
        pushed = {k // self.num_micro for k in self.chunks}
        return [
            self.contributor_of(i * self.num_micro)
            for i in sorted(pushed)
            if all(
                self.received(i * self.num_micro + m) >= slice_numel for m in range(self.num_micro)
            )
        ]


class SliceState:
    """Slice ``index`` of one job's flat buffer, with its optimizer: its state and the
    helpers every concern shares (``server.store.BufferSlice`` adds the requests)."""

    def __init__(self, req: pb.RegisterBufferRequest, optimizer: ServerOptimizer) -> None:
        self.job, self.name = req.ref.job, req.ref.buffer
        self.label = f"buffer '{self.job}/{self.name}'"
        self.spec = req
        self.run_name = req.run  # the run that registered it last, as the client named it
        self.conflict: str | None = None  # why its run's ranks disagree: their waits fail at once
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
        self.stopped: str | None = None  # why every wait ends: the server stops
        self.budget, self.reserved = MemoryBudget(), 0  # the store's, once it holds the slice
        self.turns = TurnWaits()  # the store's, once it holds the slice (runtime/turns.py)
        self.news: RankNews = NOTHING_KNOWN  # the store's, once it holds the slice
        self.turn_waiters = 0  # pushes waiting for their turn on this slice
        self.replicator: Any = None  # server.replication.Replicator when the job replicates
        self.capture_requests: Counter[int] = Counter()  # version -> snapshots waiting for it
        self.captures: dict[int, Captured] = {}
        self.cond = threading.Condition()

    @property
    def run(self) -> str:
        """The run id that registered it last (``run_name`` without a group or an epoch)."""
        return run_root(self.run_name)

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

    def wait_for(
        self,
        ready: Any,
        timeout: float,
        waiting_for: str,
    ) -> None:
        """Wait on the slice's condition (caller holds it) until ``ready()``, or fail: at the
        deadline with DEADLINE_EXCEEDED naming the ranks it waited for (``waiting_on``), at
        once with FAILED_PRECONDITION when the run's ranks disagree about the buffer
        (``conflict_with``) or once every rank whose gradient it misses ended for good (a
        peer that ran out of batches: ``ended``), asked every ``ENDED_POLL_S``; with
        CANCELLED once the call's caller went away (``wait_asking``)."""

        def settled() -> bool:
            return self.dropped or self.stopped or self.conflict is not None or ready()

        def ask() -> str:
            return self.news.ended(self.run_name, self.missing_pushes())

        what = f"{waiting_for} ({self.label})"
        done, gone = wait_asking(self.cond, settled, timeout, ask, what)
        if gone:
            raise ShardError.precondition(
                f"{self.label} is at version {self.version}; waiting for {waiting_for}: {gone}"
            )
        if self.stopped:
            raise ShardError.aborted(
                f"{self.label}: {self.stopped} while waiting for {waiting_for}"
            )
        if self.dropped:
            raise ShardError.not_found(f"{self.label} was dropped while waiting for {waiting_for}")
        if not ready() and self.conflict is not None:
            raise ShardError.precondition(
                f"{self.label}: stopped waiting for {waiting_for}: {self.conflict}"
            )
        if not done:
            run = f" (run '{self.run}')" if self.run else ""
            raise ShardError.deadline(
                f"{self.label}{run} is at version {self.version};"
                f" waited {timeout:.1f} s for {waiting_for}; {self.waiting_on()}"
            )

    def _current(self) -> PendingStep | None:
        """The pending step of this version, or None (caller holds the lock)."""
        p = self.pending
        return p if p is not None and p.step == self.version else None

    def missing_pushes(self) -> list[int]:
        """The ranks whose gradient of the current step has not arrived while the step waits
        for pushes (caller holds the lock); none for an elastic step (its members change
        instead) or before the initial values."""
        p = self._current()
        if not self.initialized or (p is not None and (p.reduced or p.members is not None)):
            return []
        return absent(range(self.contributors), set(p.arrived(self.slice_numel) if p else []))

    def waiting_on(self) -> str:
        """Who the slice waits for to move on (caller holds the lock): its initial values, the
        ranks whose gradients of the current step are missing (and what the server's leases say
        of them: ``news``), or a Step."""
        if not self.initialized:  # who writes them: the strategies' rank 0 (a field check:
            return (  # a pull of them named nobody while rank 0 had failed before it leased)
                f"its initial values are not all written (SetParams covered"
                f" {self.written.covered:,} of {self.slice_numel:,} elements; paramshard's"
                f" strategies write them from rank 0{self.news.whereabouts(self.run_name, [0])})"
            )
        step, p = self.version, self._current()
        if p is not None and p.reduced:
            return (
                f"the gradients of step {step} of all {self.contributors} rank(s) are in;"
                " no Step has applied it yet"
            )
        arrived = p.arrived(self.slice_numel) if p is not None else []
        missing = absent(range(self.contributors), set(arrived))
        return (
            f"step {step}: {len(arrived)} of {self.contributors} rank(s) pushed their"
            f" gradient; missing rank(s) {listed(missing)} (arrived: {listed(arrived)})"
            f"{self.news.whereabouts(self.run_name, missing)}"
        )

    def conflict_with(self, run: str, why: str) -> None:
        """A registration of this buffer was refused for another layout (``why``): when it
        came from the run that registered the buffer, the run's ranks disagree and their waits
        here could never complete, so they fail now, and so does any later one. Another
        run's refusal (a job name taken twice) leaves this run alone; a registration that fits
        clears it (``registered``)."""
        root = run_root(run)
        if not root or root != self.run:
            return
        with self.cond:
            self.conflict = why
            self.cond.notify_all()

    def registered(self, run: str) -> None:
        """A registration that fits (a rank of ``run``, maybe a restarted one) came in."""
        with self.cond:
            self.run_name = run or self.run_name
            self.conflict = None

    def interrupt(self, why: str) -> None:
        """The server stops: every wait on the slice ends with ``why`` (its handler thread
        returns, so the process can exit), and none starts again."""
        with self.cond:
            self.stopped = why
            self.cond.notify_all()

    def retire(self) -> None:
        """The slice left the store (dropped, replaced): waiters wake and fail, memory is freed."""
        with self.cond:
            if not self.dropped:
                self.dropped = True
                self.budget.release(self.reserved, "buffers")
                self.budget.release(self.pending.staged_charge if self.pending else 0, "staging")
                self.cond.notify_all()

    def bytes_by_kind(self) -> tuple[int, int, int]:
        """(params, gradients: accumulator and staged contributions, optimizer state)."""
        grad = 0 if self.grad is None else int(self.grad.nbytes)
        grad += self.pending.staged_bytes if self.pending is not None else 0
        return int(self.master.nbytes), grad, int(self.optimizer.state_bytes())


def buffer_bytes(slice_numel: int, itemsize: int, state_arrays: int) -> int:
    """What a slice may come to: params, the gradient accumulator and ``state_arrays``
    optimizer-state arrays, each ``slice_numel`` elements of the master dtype."""
    return slice_numel * itemsize * (2 + state_arrays)


SLICE_RECORD_BYTES = 8192
"""What a slice's own record costs beside its arrays (its state, optimizer, lock, entry in
the store; measured with CPython 3.11: 6,288 bytes for a slice of one element, of which the
budget paid 12 before: 30,000 such buffers took 163 MiB in review)."""


def slice_bytes(req: pb.RegisterBufferRequest) -> int:
    """``buffer_bytes`` of the slice ``req`` registers here (its optimizer's state arrays, in
    its master dtype: float64 for a float64 model, else float32), plus what the slice keeps of
    the request: the model config and the parameters' records (names, aliases, shapes), and
    its own record."""
    start, stop = slicing.slice_bounds(req.numel, req.num_servers, req.server_index)
    optimizer = OPTIMIZERS.get(req.optimizer.name)
    states = len(optimizer.state_names) if optimizer is not None else 0
    size = master_itemsize(req)
    records = sum(p.ByteSize() for p in req.params)
    kept = len(req.model_config) + records + SLICE_RECORD_BYTES
    return buffer_bytes(stop - start, size, states) + kept
