"""Elastic membership: which data-parallel ranks train each step of a job, agreed on one server.

An elastic ZeRO-1/2 or FSDP job (``ShardingConfiguration(elastic=True)``) keeps every byte of its
state on the servers, so the ranks that train it may change between steps. Each step's members
are decided by the job's *coordinator*, server 0 of its placement (the server every rank's
client calls index 0), in *rounds*. The protocol, in the order its calls happen:

1. **Announce.** A rank that is to train step ``s`` (the servers' version: the step being
   accumulated) sends ``Join(run, job, rank, step=s, epoch)`` to the coordinator and waits,
   asking again every few seconds, until the round is decided.
2. **Decide.** The first Join for ``s`` opens round ``s``. It *expects* the members of step
   ``s-1`` (without that record, a new job or a coordinator that restarted: the ranks its
   opening request names in ``known_members``, which a client sends only when a reply asks,
   ``send_known``), less those found lost: a rank whose lease on this server lapsed or was
   released after it had held one (``_Liveness``; server/collectives/leases.py), one that
   never held one here while others do, unheard for ``UNSEEN_S`` (``ElasticJob.alive``: a
   coordinator that restarted), or one that left (step 6). The round is decided once every
   expected rank has announced, or ``window_ms`` after the first expected rank did, whichever
   comes first, and in either case only once at least ``min_members`` ranks are there: below
   that it stays open and the ranks keep waiting (the client bounds the wait and names the
   ranks there and the minimum in its error). Ranks that only join (not expected) never open
   the window: they wait for the others to finish ``s-1``. The members are the ranks there,
   ascending; generation 0.
3. **Reply.** A member gets the members, the generation and the run's *epoch* (the highest any
   of its ranks has sent, so a rank that starts late, in an epoch the others left when it was
   aborted, moves on too): every member moves its collectives there, so the step's group
   collectives (``<run>.e<epoch>/s<step>g<generation>``) meet. A rank that is not a member (it
   came after the decision, or missed the window) gets ``next_step = s + 1`` and joins that
   round: a new or restarted rank adopts the servers' step, as a resumed job does. A Join for
   a step this server has already applied gets ``next_step`` = its version. A reply not
   decided yet, or sending a rank on to the version, says how many steps this server has
   ``applied``: a rank waiting to join a step at or past its training loop's end (the
   client's ``until``) stops once that many are applied, instead of waiting below the
   minimum for ranks that finished.
4. **Train.** Each member pushes its gradients of ``s`` with ``StepMembership(generation,
   members, global_batch)``; every server of the job takes contributions from those ranks only,
   weights member i's micro-batch j by ``n_ij / global_batch`` (its rows by the slice rule of
   protos/slicing.py) and sums them in rank order (server/buffers/contributions.py), so the
   reduced gradient is the mean over the global batch whoever trained it.
5. **Revise.** A member lost during ``s`` (its lease lapses: the run's epoch is aborted and every
   rank's calls end, client/leases.py) or leaving (step 6) makes the others abandon ``s``; they
   move to a newer epoch and Join ``s`` again. A member that Joins decided round ``s`` in an
   epoch above the round's (the round's collectives were aborted), while this server has not
   applied ``s``, reopens it as generation ``g + 1``, expecting its members but the ones gone
   (step 2); so does any Join when every member of ``s`` is gone. Pushes of generation
   ``g + 1`` discard what a server accumulated for ``g``; pushes, GradNorms and Steps of ``g``
   are refused from then on (FAILED_PRECONDITION), so a member that missed the abort redoes the
   step too. Non-members and members in the round's own epoch only read the decision. A round
   is never decided before the step before it was applied here; a rank waiting for it while
   every member of the servers' step is gone, or while that step, reopened, waits below its
   minimum, is sent to that step instead.
6. **Leave.** A rank that ends (normally, or a ``LocalCluster`` rank that raised) sends
   ``Join(leave=True)``: it is dropped from rounds not decided and recorded; the reply's
   ``in_flight`` says whether it was a member of a step not applied yet. A rank that had begun
   training that step (its batch part taken, a forward or a push made) then ends its epoch
   (``RunState.give_up``), so the others redo the step without it (step 5); one that only
   joined it (a rank that came as the job ended) ends nothing.
7. **Recover.** After a server was lost and came back, the ranks that find the job's servers
   inconsistent Join a *recovery round* named by their new epoch (``recovery=True``), decided as
   in step 2. Its lowest live member restores the job (neighbour replicas or the newest
   snapshot) and sends ``done``; the others, members or late, wait for ``done``. If the leader
   is lost first, the next lowest live member leads; if every member is, the lowest live rank
   that came late.

Everything is bounded: at most ``max_jobs`` jobs (half of them made by one token: ``check_share``
in rounds.py), ``KEPT_ROUNDS`` rounds (fewer for jobs of
many ranks, ``kept_rounds``) and ``KEPT_EVENTS`` history events per job, member lists no longer
than the job's world size, and ``MAX_SLOTS`` ranks in all jobs' records together (a round
that would pass it is refused with RESOURCE_EXHAUSTED); a job untouched for ``forget_s`` is
forgotten (``sweep``), and DropJob forgets it at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.rounds import (
    JOB_RECORDS,
    MAX_SLOTS,
    ElasticJob,
    Round,
    check_request,
    check_share,
    kept_rounds,
    other_run,
    slots,
    status_row,
)
from paramshard.server.runtime.errors import ShardError

__all__ = ["MembershipTable"]

POLL_S = 2.0
"""How long one Join waits for its round's decision before replying "not yet" (the client asks
again), so a waiting rank holds a server thread only briefly and sees its own notices."""
CHECK_S = 0.1
"""How often a waiting Join looks at the leases again (lapses are not signalled)."""
LISTED = 16
"""Ranks an undecided reply lists (the lowest): a client's error names them."""
ASKS_A_SECOND = 500
"""A Join answered before it could wait (the server had no thread to spare: ``ANSWERS_AT_ONCE``
in server/rpc/admission.py) is told to ask again after a pause that keeps a round's ranks to
about this many asks a second, between ``MIN_PAUSE_S`` and ``POLL_S``."""
MIN_PAUSE_S = 0.1


class _Liveness(Protocol):
    """What the table needs of the lease table: which ranks of a run hold a live lease here."""

    def live_ranks(self, run: str) -> frozenset[int] | None: ...


class MembershipTable:
    """Every elastic job this server coordinates (see the module docstring)."""

    def __init__(
        self,
        liveness: _Liveness,
        version_of: Callable[[str], int | None],
        *,
        forget_s: float = 600.0,
        max_jobs: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """``version_of(job)``: this server's version of the job (None: it holds none)."""
        self.liveness, self.version_of = liveness, version_of
        self.forget_s, self.max_jobs = forget_s, max_jobs
        self.clock, self.wall = clock, wall
        self._cond = threading.Condition()
        self._jobs: dict[str, ElasticJob] = {}

    # -- the RPC ---------------------------------------------------------------------------
    def join(self, req: pb.JoinRequest, timeout: float, owner: str | None = None) -> pb.JoinReply:
        """``owner``: the caller (its token), whose share a job it makes counts against."""
        check_request(req)
        began = self.clock()
        deadline = began + max(0.0, min(timeout, POLL_S))
        with self._cond:
            job = self._jobs.get(req.job)
            if job is not None and other_run(job, req, self.liveness.live_ranks(job.run)):
                wait = round(1000 * POLL_S)  # until its leases lapse here
                return pb.JoinReply(step=req.step, epoch=req.epoch, retry_after_ms=wait)
            job = self._job_for(req, owner)
            job.epoch = max(job.epoch, req.epoch)
            if req.leave:
                return self._leave(job, req)
            job.left.discard(req.rank)  # a rank that left may come back (a restart)
            job.joined_at[req.rank] = self.clock()  # heard: alive a while without a lease
            while True:
                reply, final = self._recovery(job, req) if req.recovery else self._step(job, req)
                if final or self.clock() >= deadline:
                    return reply or self._undecided(job, req, self.clock() - began)
                self._cond.wait(min(CHECK_S, max(0.0, deadline - self.clock())))

    def drop(self, job: str) -> bool:
        """Forgets ``job`` (DropJob); whether it was here."""
        with self._cond:
            gone = self._jobs.pop(job, None)
            self._cond.notify_all()
        return gone is not None

    def sweep(self) -> None:
        """Forgets jobs untouched for ``forget_s`` (the server's sweeper calls it)."""
        with self._cond:
            now = self.clock()
            for name, job in list(self._jobs.items()):
                if now - job.touched > self.forget_s:
                    del self._jobs[name]

    def status(self) -> list[pb.JobMembership]:
        """One row per job: its newest decided step, counts and history (Status, metrics)."""
        with self._cond:
            return [status_row(name, job) for name, job in sorted(self._jobs.items())]

    # -- rounds (caller holds the lock) -----------------------------------------------------
    def _job_for(self, req: pb.JoinRequest, owner: str | None) -> ElasticJob:
        now = self.clock()
        job = self._jobs.get(req.job)
        if job is not None and (job.run, job.world_size) != (req.run, req.world_size):
            if req.leave:  # a rank of an older run saying goodbye: nothing to do with this one
                raise ShardError.precondition(
                    f"Join: job '{req.job}' is trained by run '{job.run}' here, not '{req.run}'"
                )
            if owner != job.owner:
                check_share(self._jobs.values(), owner, self.max_jobs, req)
            self._room_for(JOB_RECORDS * req.world_size - slots(job), req)
            # a new run, once the old one holds no lease here (``other_run``)
            fresh = ElasticJob(req.run, req.world_size, now, owner, history=job.history)
            job = self._jobs[req.job] = fresh
        if job is None:
            if len(self._jobs) >= self.max_jobs:
                raise ShardError.exhausted(
                    f"Join: this server coordinates {len(self._jobs)} elastic jobs, its limit;"
                    f" job '{req.job}' was not added"
                )
            check_share(self._jobs.values(), owner, self.max_jobs, req)
            self._room_for(JOB_RECORDS * req.world_size, req)
            job = self._jobs[req.job] = ElasticJob(req.run, req.world_size, now, owner)
        job.touched = now
        return job

    def _room_for(self, more: int, req: pb.JoinRequest) -> None:
        """Refuses (RESOURCE_EXHAUSTED) records of ``more`` ranks that would take every job's
        past ``MAX_SLOTS`` (caller holds the lock; at most ``max_jobs`` jobs to add up)."""
        held = sum(slots(j) for j in self._jobs.values())
        if held + more > MAX_SLOTS:
            raise ShardError.exhausted(
                f"Join: this server's elastic jobs hold records of {held:,} ranks; a round of"
                f" job '{req.job}' ({req.world_size:,} ranks) would pass its bound of"
                f" {MAX_SLOTS:,}"
            )

    def _alive(self, job: ElasticJob) -> Callable[[int], bool]:
        """Whether a rank counts as alive (``ElasticJob.alive``)."""
        return job.alive(self.liveness.live_ranks(job.run), self.clock())

    def _open(
        self, job: ElasticJob, key: int, req: pb.JoinRequest, previous: Round | None
    ) -> Round:
        before = set(previous.members) if previous is not None else set()
        expected = before or set(req.known_members)
        return Round(key, expected, max(1, req.min_members), req.window_ms / 1000, before=before)

    def _step(self, job: ElasticJob, req: pb.JoinRequest) -> tuple[pb.JoinReply | None, bool]:
        """Steps 1-3 and 5 for a step round: (the reply, whether it is final)."""
        s, version = req.step, self.version_of(req.job)
        if version is not None and s < version:
            reply = pb.JoinReply(decided=True, step=s, next_step=version, epoch=job.epoch)
            reply.applied = version
            return reply, True
        if version is not None and s > version + 1:
            raise ShardError.precondition(
                f"Join: step {s} of job '{req.job}' is ahead of the servers (version {version})"
            )
        rnd = job.rounds.get(s)
        if rnd is None:
            prev = job.rounds.get(s - 1)
            previous = prev if prev is not None and prev.decided else job.last
            if previous is None and not req.known_members:
                return self._send_known(job, req), True
            if len(job.rounds) < kept_rounds(job.world_size):  # else one is dropped for it
                self._room_for(job.world_size, req)
            rnd = job.rounds[s] = self._open(job, s, req, previous)
            while len(job.rounds) > kept_rounds(job.world_size):
                del job.rounds[min(job.rounds)]
        alive = self._alive(job)
        ahead = version is not None and s > version  # step s-1 is not applied here yet
        if ahead:
            current = job.rounds.get(version)
            if current is not None and current.needs_help(alive):
                reply = pb.JoinReply(decided=True, step=s, next_step=version, epoch=job.epoch)
                return reply, True  # join the servers' step instead
        if rnd.decided:
            applied = version is not None and version > s
            orphaned = not applied and not any(map(alive, rnd.members))
            back = req.rank in rnd.member_set and req.epoch > rnd.epoch
            if applied or not (orphaned or back):
                return rnd.decided_reply(req.rank, job.epoch), True
            # a member back in a newer epoch (the round's epoch was aborted), or a step whose
            # members are all gone: its ranks start it again (step 5)
            job.revise(rnd, [m for m in rnd.members if not alive(m)], self.wall())
        self._announce(rnd, req)
        if ahead or not self._decide(job, rnd, alive, step=True):
            return None, False  # a round is decided once the step before it was applied
        return rnd.decided_reply(req.rank, job.epoch), True

    def _recovery(self, job: ElasticJob, req: pb.JoinRequest) -> tuple[pb.JoinReply | None, bool]:
        """Step 7: (the reply, whether it is final: the round is done, or this rank leads)."""
        rnd = job.recoveries.get(req.epoch)
        if rnd is None:
            if not req.known_members:
                return self._send_known(job, req), True
            if len(job.recoveries) < kept_rounds(job.world_size):
                self._room_for(job.world_size, req)
            rnd = job.recoveries[req.epoch] = self._open(job, req.epoch, req, job.last)
            rnd.expected |= set(req.known_members)
            rnd.min_members = 1  # restoring needs one rank
            while len(job.recoveries) > kept_rounds(job.world_size):
                del job.recoveries[min(job.recoveries)]
        if req.done:
            rnd.done = True
            self._cond.notify_all()
        if not rnd.decided:
            self._announce(rnd, req)
        else:  # a late rank: it leads should every member be lost before restoring
            rnd.announced.setdefault(req.rank, req.epoch)
        alive = self._alive(job)
        if not self._decide(job, rnd, alive, step=False):
            return None, False
        live = [m for m in rnd.members if alive(m)]  # else a late rank, else the members
        live = live or sorted(r for r in rnd.announced if alive(r)) or list(rnd.members)
        reply = pb.JoinReply(
            decided=True,
            member=req.rank in rnd.member_set,
            generation=rnd.generation,
            members=rnd.members,
            epoch=max(rnd.epoch, job.epoch),
            leader=live[0],
            done=rnd.done,
        )
        return reply, rnd.done or live[0] == req.rank

    def _announce(self, rnd: Round, req: pb.JoinRequest) -> None:
        if req.rank not in rnd.announced:
            self._cond.notify_all()
        rnd.announced[req.rank] = max(req.epoch, rnd.announced.get(req.rank, 0))
        rnd.min_members = max(rnd.min_members, req.min_members)
        rnd.window_s = max(rnd.window_s, req.window_ms / 1000)

    def _decide(
        self, job: ElasticJob, rnd: Round, alive: Callable[[int], bool], step: bool
    ) -> bool:
        """Decides ``rnd`` when its rule says so (step 2); whether it is decided."""
        if rnd.decided:
            return True
        now = self.clock()
        if rnd.window_start is None and (
            any(r in rnd.expected and alive(r) for r in rnd.announced)
            or not any(map(alive, rnd.expected))  # nobody it expects is alive
        ):
            rnd.window_start = now
        expired = rnd.window_start is not None and now - rnd.window_start >= rnd.window_s
        if not expired and rnd.unheard(alive):  # each Join of a large round costs O(1) here
            rnd.below_min = False
            return False
        present = {r for r in rnd.announced if alive(r)}
        rnd.below_min = len(present) < rnd.min_members
        if rnd.below_min:
            return False
        # the run's newest epoch: a rank that comes late, still in an aborted one, moves on
        rnd.decide(tuple(sorted(present)), max(job.epoch, *(rnd.announced[r] for r in present)))
        if step:
            job.record(rnd, alive, self.wall())
        self._cond.notify_all()
        return True

    def _undecided(self, job: ElasticJob, req: pb.JoinRequest, waited: float) -> pb.JoinReply:
        """The reply "not yet", after ``waited`` s; one that could not wait asks again later."""
        rnd = (job.recoveries if req.recovery else job.rounds).get(
            req.epoch if req.recovery else req.step
        )
        reply = pb.JoinReply(decided=False, step=req.step, epoch=job.epoch)
        version = None if req.recovery else self.version_of(req.job)
        if version is not None:  # a rank waiting past its loop's end stops at this (step 3)
            reply.applied = version
        if waited < POLL_S / 2:
            crowd = len(rnd.announced) if rnd is not None else 1
            pause = min(POLL_S, max(MIN_PAUSE_S, crowd / ASKS_A_SECOND))
            reply.retry_after_ms = max(0, round(1000 * (pause - waited)))
        if rnd is not None:
            reply.below_min = rnd.below_min
            reply.announced_count, reply.expected_count = len(rnd.announced), len(rnd.expected)
            reply.expected.extend(rnd.lowest_expected(LISTED))
            if rnd.below_min:  # fewer than min_members are there: the client's error lists them
                reply.announced.extend(sorted(rnd.announced)[:LISTED])
        return reply

    def _send_known(self, job: ElasticJob, req: pb.JoinRequest) -> pb.JoinReply:
        """A round must be opened and nothing says whom it expects: no round of the job was
        decided here (a new job, or this server restarted) and the request carries no
        ``known_members``. The client asks again with them (steps 2 and 7)."""
        return pb.JoinReply(decided=False, send_known=True, step=req.step, epoch=job.epoch)

    def _leave(self, job: ElasticJob, req: pb.JoinRequest) -> pb.JoinReply:
        """Step 6: the rank leaves; whether it was a member of a step not applied yet."""
        job.left.add(req.rank)
        for rnd in [*job.rounds.values(), *job.recoveries.values()]:
            if not rnd.decided:
                rnd.announced.pop(req.rank, None)
                rnd.expected.discard(req.rank)
        last, version = job.last, self.version_of(req.job)
        in_flight = (
            last is not None
            and req.rank in last.member_set
            and (version is None or version <= last.key)
        )
        self._cond.notify_all()
        return pb.JoinReply(decided=True, in_flight=in_flight, epoch=job.epoch)
