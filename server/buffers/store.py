"""The buffer store: every job's buffer slices on this server, registration and quotas.

A slice (``BufferSlice``) is put together from one class per concern: its state
(server/buffers/slice_state.py, which states the wire semantics), contributions and pulls
(server/buffers/contributions.py), norms and optimizer steps (server/buffers/steps.py), and snapshot
captures and restores (server/buffers/captures.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from paramshard.protos import shard_pb2 as pb
from paramshard.protos import slicing
from paramshard.server.buffers.captures import Captures
from paramshard.server.buffers.contributions import Contributions
from paramshard.server.buffers.slice_state import PendingStep, master_dtype, slice_bytes
from paramshard.server.buffers.spec_checks import check_spec
from paramshard.server.buffers.steps import Steps
from paramshard.server.optimizers import OptimizerError, make_optimizer
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.limits import MemoryBudget
from paramshard.server.runtime.run_names import NOTHING_KNOWN, RankNews
from paramshard.server.runtime.turns import TurnWaits

__all__ = ["BufferSlice", "BufferStore", "PendingStep", "master_dtype", "status_row"]


class BufferSlice(Contributions, Steps, Captures):
    """Slice ``index`` of one job's flat buffer, with its optimizer."""


class BufferStore:
    """All buffers of all jobs on this server."""

    def __init__(self, max_job_bytes: int = 0, budget: MemoryBudget | None = None) -> None:
        self.max_job_bytes = max_job_bytes  # 0: unbounded
        self.budget = budget or MemoryBudget()  # the server's memory, shared with slots etc.
        self.turns = TurnWaits()  # none wait until the server sets the bound (app.py)
        self.news: RankNews = NOTHING_KNOWN  # the server's leases (servicer.py)
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[str, BufferSlice]] = {}
        self.added: Callable[[str, list[BufferSlice], str], None] = lambda job, slices, how: None
        """Told of slices that joined a job, once they are in, and how: "registered", or
        replacing all the job's, "snapshot" (a Restore: another history) or "replica" (a
        rollback or a loaded replica: the job's own history, at a version every server
        reaches). The servicer's replicator (``Replicator.adopt``)."""

    def get(self, job: str, buffer: str) -> BufferSlice:
        with self._lock:
            buffers = self._jobs.get(job)
            if buffers is None:  # names no other job: the caller's token may not see them
                raise ShardError.not_found(
                    f"job '{job}' is not on this server (never registered, dropped, or lost"
                    " when the server restarted)"
                )
            found = buffers.get(buffer)
        if found is None:
            raise ShardError.not_found(f"job '{job}' has no buffer '{buffer}'")
        return found

    def jobs(self) -> dict[str, list[BufferSlice]]:
        with self._lock:
            return {job: list(b.values()) for job, b in self._jobs.items()}

    def register(self, req: pb.RegisterBufferRequest) -> BufferSlice:
        label = check_spec(req, "RegisterBuffer")
        try:
            return self._register(req, label)
        except _Refused as exc:  # its run's ranks disagree: theirs fail too (conflict_with)
            exc.existing.conflict_with(req.run, exc.conflict)
            raise

    def _register(self, req: pb.RegisterBufferRequest, label: str) -> BufferSlice:
        need = slice_bytes(req)
        with self._lock:
            existing = self._fitting(req, label)
            if existing is None:  # before anything is allocated
                self._check_quota(req.ref.job, need, label)
        if existing is not None:
            existing.registered(req.run)
            return existing
        self.budget.reserve(need, "buffers", label)
        try:
            created = self._create(req, label)
            with self._lock:  # again: another call may have registered meanwhile
                existing = self._fitting(req, label)
                if existing is None:
                    self._check_quota(req.ref.job, need, label)
                    created.budget, created.reserved = self.budget, need
                    created.turns, created.news = self.turns, self.news
                    self._jobs.setdefault(req.ref.job, {})[req.ref.buffer] = created
        except BaseException:
            self.budget.release(need, "buffers")
            raise
        if existing is None:
            self.added(req.ref.job, [created], "registered")
            return created
        self.budget.release(need, "buffers")
        existing.registered(req.run)
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
        differs = _differences(old, req)
        if differs:
            raise _Refused(existing, label, differs, old.contributors != req.contributors)
        return existing

    def _check_quota(self, job: str, need: int, what: str, replacing: bool = False) -> None:
        """RESOURCE_EXHAUSTED unless ``need`` more bytes for ``job`` (``replacing``: instead of
        its slices here) fit ``--max-job-gb``. A slice counts with what it reserved
        (``slice_bytes``: every array it may allocate), so registrations at once cannot pass
        the quota together; under the store's lock."""
        if not self.max_job_bytes:
            return
        if not replacing:
            need += sum(b.reserved for b in self._jobs.get(job, {}).values())
        if need > self.max_job_bytes:
            raise ShardError.exhausted(
                f"{what}: job '{job}' would need {need:,} bytes on this server, over its quota"
                f" of {self.max_job_bytes:,}"
            )

    def check_room(self, job: str, specs: list[pb.RegisterBufferRequest], what: str) -> None:
        """Job ``job`` restored as ``specs`` (its slices here now go) fits its quota."""
        with self._lock:
            self._check_quota(job, sum(map(slice_bytes, specs)), what, replacing=True)

    def replace_job(self, job: str, slices: list[BufferSlice], how: str, new: bool = False) -> None:
        """Swaps a job's buffers for restored ones in one go; waiters on the old ones wake.
        ``how``: "snapshot" or "replica" (``added``). ``new``: the job must not exist (a
        restore under another name): FAILED_PRECONDITION, nothing changed, when it does."""
        need = [slice_bytes(b.spec) for b in slices]
        self.budget.reserve(sum(need), "buffers", f"restore of job '{job}'")
        for b, n in zip(slices, need, strict=True):
            b.budget, b.reserved, b.turns, b.news = self.budget, n, self.turns, self.news
        with self._lock:
            taken = new and job in self._jobs
            if not taken:
                old = self._jobs.pop(job, {})
                self._jobs[job] = {b.name: b for b in slices}
        if taken:
            self.budget.release(sum(need), "buffers")
            raise ShardError.precondition(
                f"restore as '{job}': a job of that name is on this server already (made"
                " meanwhile); restore as a new name, or drop that job first"
            )
        for b in old.values():
            b.retire()
        self.added(job, slices, how)

    def interrupt(self, why: str) -> None:
        """The server stops: every wait on a slice ends (``SliceState.interrupt``)."""
        for slices in self.jobs().values():
            for b in slices:
                b.interrupt(why)

    def drop(self, job: str) -> int:
        with self._lock:
            dropped = self._jobs.pop(job, None)
        if dropped is None:
            raise ShardError.not_found(f"job '{job}' is not on this server")
        for b in dropped.values():  # waiters fail fast; pending contributions go with them
            b.retire()
        return len(dropped)

    def status(self, wanted: Callable[[str], bool] | None = None) -> list[pb.JobStatus]:
        """One row per job on this server (those ``wanted`` says, every one without it), one
        per buffer slice in it (Status, snapshots): a token's Status, or a snapshot of one job,
        reads no other job."""
        out = []
        for job, buffers in sorted(self.jobs().items()):
            if wanted is not None and not wanted(job):
                continue
            rows = [status_row(b) for b in buffers]
            first = buffers[0].spec if buffers else None
            out.append(
                pb.JobStatus(
                    job=job,
                    buffers=rows,
                    server_index=first.server_index if first else 0,
                    num_servers=first.num_servers if first else 0,
                    model_config=next(
                        (b.spec.model_config for b in buffers if b.spec.model_config), ""
                    ),
                )
            )
        return out


def status_row(b: BufferSlice) -> pb.BufferStatus:
    """Slice ``b`` as Status and a snapshot's reply describe it."""
    with b.cond:
        params, grads, opt = b.bytes_by_kind()
        return pb.BufferStatus(
            buffer=b.name,
            numel=b.numel,
            slice_start=b.start,
            slice_numel=b.slice_numel,
            dtype=str(b.dtype),
            version=b.version,
            initialized=b.initialized,
            optimizer=b.optimizer.name,
            param_bytes=params,
            grad_bytes=grads,
            optimizer_bytes=opt,
            params=b.spec.params,
            last_step_seconds=b.last_step_seconds,
            last_step_unix=b.last_step_unix,
            contributors=b.contributors,
            hyper={k: float(v) for k, v in b.optimizer.hyper.items()},
            state_keys=sorted(b.optimizer.state_arrays()),
            optimizer_steps=b.optimizer.step_count,
            skipped_steps=b.skipped_steps,
        )


def _differences(old: pb.RegisterBufferRequest, new: pb.RegisterBufferRequest) -> str:
    """What a refused registration says differently (``contributors 3 here, 2 asked``)."""
    pairs = [
        ("numel", f"{old.numel:,}", f"{new.numel:,}"),
        ("servers", str(old.num_servers), str(new.num_servers)),
        ("slice", str(old.server_index), str(new.server_index)),
        ("contributors (data-parallel ranks)", str(old.contributors), str(new.contributors)),
        ("optimizer", old.optimizer.name, new.optimizer.name),
        ("master dtype", master_dtype(old), master_dtype(new)),
        ("sums", *("arrival order" if r.arrival_order else "rank order" for r in (old, new))),
    ]
    out = [f"{name} {a} here, {b} asked" for name, a, b in pairs if a != b]
    if list(old.params) != list(new.params):
        out.append("other parameters (names, shapes or offsets)")
    return "; ".join(out)


class _Refused(ShardError):
    """A registration of ``existing`` with another layout (FAILED_PRECONDITION)."""

    def __init__(self, existing: BufferSlice, label: str, differs: str, other_ranks: bool) -> None:
        # a job restored from a snapshot keeps the snapshot's ranks unless the restore says
        ranks = (
            "; a snapshot restored for another number of ranks takes `paramshard restore JOB"
            " --tag TAG --contributors N` (N: the data-parallel ranks that will train it)"
            if other_ranks
            else ""
        )
        super().__init__(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{label} exists with another layout ({differs}): the ranks of one run disagree"
            " (world size, model or configuration), or another job used this name (drop the"
            f" job first){ranks}",
        )
        self.existing = existing
        self.conflict = (
            f"a rank registered it with another layout ({differs}): the ranks of this run"
            " disagree about the world size, the model or the configuration"
        )
