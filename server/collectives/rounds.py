"""The records of elastic membership (server/collectives/membership.py numbers the protocol):
a round (one step's, or one recovery's), a job's rounds and history, their Status rows, and the
checks a Join request passes before anything changes."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice

from paramshard.protos import shard_pb2 as pb
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.request_bounds import MAX_NAME, check_epoch, check_version

__all__ = [
    "JOB_RECORDS", "ElasticJob", "KEPT_EVENTS", "KEPT_ROUNDS", "MAX_SLOTS", "Round",
    "UNSEEN_S", "check_request", "check_share", "other_run", "kept_rounds", "slots", "status_row",
]  # fmt: skip

KEPT_ROUNDS = 64
UNSEEN_S = 30.0
"""How long a rank that never held a lease on the coordinator counts as alive there, from its
last Join, or from when the coordinator first found another rank of its run holding a lease
(a witness), whichever is later. A coordinator that restarted knows no lease yet: a live rank
renews it within a second or two of its stream breaking (client/leases.py), its channel
reconnecting within 5 s (client/cluster.py), and 30 s is the clients' default lease TTL, the
time a rank with no stream gets between renewals. A rank that died before renewing it (a
recovery round's leader killed as it was told to lead) counts as gone from then on, so the
next live member leads; before, such a rank counted as alive until the others' bound
(``elastic_wait_s``, 600 s by default)."""
MAX_SLOTS = 1 << 21
"""Rank slots every elastic job's records on one server may hold together (``slots``). A
round holds sets of its job's ranks, up to the world size each, at about 56 bytes a rank, so
requests naming many known members cannot grow the server past about 120 MB of them."""
JOB_SLOTS = MAX_SLOTS // 4
"""One job's share: a job of 65,536 ranks keeps its last 8 rounds, one of 8,192 or fewer its
last ``KEPT_ROUNDS``."""
KEPT_EVENTS = 64
JOB_RECORDS = 3
"""A job's records of ranks besides its rounds: seen alive, left, last joined (``slots``)."""
MAX_WORLD = 65536
MAX_WINDOW_MS = 3_600_000


def kept_rounds(world_size: int) -> int:
    """How many step (or recovery) rounds a job of ``world_size`` ranks keeps."""
    return max(2, min(KEPT_ROUNDS, JOB_SLOTS // world_size))


def slots(job: ElasticJob) -> int:
    """What ``job``'s records may hold at most, in ranks: every round it keeps, its last
    decided round, who was seen alive or left and when each rank last joined, each up to its
    world size."""
    return job.world_size * (len(job.rounds) + len(job.recoveries) + JOB_RECORDS)


@dataclass
class Round:
    """One round: a step's membership (revised into generations), or a recovery's."""

    key: int  # the step, or for a recovery round the epoch
    expected: set[int]
    min_members: int
    window_s: float
    before: set[int]  # the members it follows (history: who joined, who left)
    announced: dict[int, int] = field(default_factory=dict)  # rank -> its epoch
    window_start: float | None = None
    decided: bool = False
    generation: int = 0
    members: tuple[int, ...] = ()
    member_set: frozenset[int] = frozenset()  # ``members``, to ask in O(1)
    member_reply: pb.JoinReply | None = None  # a member's reply, built once (``decided_reply``)
    epoch: int = 0
    done: bool = False  # recovery rounds
    below_min: bool = False  # all there, but fewer than min_members
    order: list[int] | None = None  # ``expected`` sorted, once: ``unheard`` walks it
    cursor: int = 0  # ``order`` before it: announced, left or not alive when last looked at

    def unheard(self, alive: Callable[[int], bool]) -> bool:
        """Whether an expected rank that is alive has not announced itself yet.

        A round of W ranks is asked this at each of its W Joins. The walk goes on from where
        the last one stopped (ranks announce, they do not take it back), so a round's walks
        take O(W) together; at the end one full look confirms, since a rank skipped as not
        alive may have come back."""
        if self.order is None:
            self.order = sorted(self.expected)
        while self.cursor < len(self.order):
            r = self.order[self.cursor]
            if r in self.expected and r not in self.announced and alive(r):
                return True
            self.cursor += 1
        if any(r not in self.announced and alive(r) for r in self.expected):
            self.cursor = 0  # a rank came back: walk again
            return True
        return False

    def lowest_expected(self, n: int) -> list[int]:
        """The lowest ``n`` ranks the round expects, without sorting them again."""
        if self.order is None:
            self.order = sorted(self.expected)
        return list(islice((r for r in self.order if r in self.expected), n))

    def decide(self, members: tuple[int, ...], epoch: int) -> None:
        """The round is decided: these members, in this epoch."""
        self.decided, self.members, self.member_set = True, members, frozenset(members)
        self.epoch, self.member_reply = epoch, None

    def decided_reply(self, rank: int, job_epoch: int) -> pb.JoinReply:
        """What this decided step round tells ``rank`` (protocol step 3). A member's reply is
        built once and copied for each (a non-member's says so and where to go): each of W
        members asks at least once, and building the W members into each reply was most of
        what a step cost its coordinator."""
        if self.member_reply is None:
            self.member_reply = pb.JoinReply(
                decided=True,
                member=True,
                step=self.key,
                generation=self.generation,
                members=self.members,
                epoch=self.epoch,
                leader=self.members[0],
            )
        reply = pb.JoinReply()
        reply.CopyFrom(self.member_reply)
        if rank not in self.member_set:  # too late for this step: the next one
            reply.member, reply.next_step = False, self.key + 1
            reply.epoch = max(self.epoch, job_epoch)
        return reply

    def needs_help(self, alive: Callable[[int], bool]) -> bool:
        """Whether this round, the servers' step, cannot end without the ranks waiting for the
        next one: decided, every member of it is gone; undecided, it waits below its minimum
        (as a round reopened without a lost member does). Such a rank, parked for the next
        step when the round was decided without it (a restarted rank), would otherwise wait on
        a round that waits for it."""
        if self.decided:
            return not any(map(alive, self.members))
        return self.below_min

    def reopen(self, expected: set[int]) -> None:
        """A new generation expecting ``expected``: nobody has announced yet."""
        self.before = self.expected = expected
        self.decided, self.members, self.announced, self.window_start = False, (), {}, None
        self.member_set, self.member_reply = frozenset(), None
        self.order, self.cursor = None, 0


@dataclass
class ElasticJob:
    """One elastic job on its coordinator: its rounds, who was seen alive or left, counts."""

    run: str
    world_size: int
    touched: float
    owner: str | None = None  # the caller (token) whose Join made it: its share counts it
    rounds: dict[int, Round] = field(default_factory=dict)
    recoveries: dict[int, Round] = field(default_factory=dict)
    last: Round | None = None  # the newest step round decided
    seen_live: set[int] = field(default_factory=set)
    seen_from: frozenset[int] | None = None  # the live set last added to ``seen_live``
    watched_from: float | None = None  # when a rank of the run first held a lease here
    joined_at: dict[int, float] = field(default_factory=dict)  # rank -> its last Join
    left: set[int] = field(default_factory=set)
    epoch: int = 0
    joins: int = 0
    leaves: int = 0
    revisions: int = 0
    steps_by_size: Counter = field(default_factory=Counter)
    history: deque = field(default_factory=lambda: deque(maxlen=KEPT_EVENTS))

    def alive(self, live: frozenset[int] | None, now: float) -> Callable[[int], bool]:
        """Whether a rank counts as alive, given the ranks of the run holding a live lease on
        this server (``live``; None: it knows no lease of the run): not left, and holding a
        live lease here; or never seen holding one (a coordinator that restarted knows no
        leases yet) and either nobody holds one here now (no witness: this server may be cut
        off) or it was heard within ``UNSEEN_S``."""
        if live is not None and live is not self.seen_from:  # the same set: nothing new seen
            self.seen_live |= live
            self.seen_from = live
        if live and self.watched_from is None:
            self.watched_from = now
        since = self.watched_from if self.watched_from is not None else now
        left, seen, joined = self.left, self.seen_live, self.joined_at

        def alive(r: int) -> bool:
            if r in left:
                return False
            if live is None or r in live:
                return True
            if r in seen:
                return False
            return not live or now - max(since, joined.get(r, since)) < UNSEEN_S

        return alive

    def revise(self, rnd: Round, gone: list[int], unix: float) -> None:
        """Reopens decided step round ``rnd`` as generation g + 1, expecting its members but
        the ``gone`` ones (step 5 of server/collectives/membership.py)."""
        self.revisions += 1
        self.steps_by_size[len(rnd.members)] -= 1
        for r in gone:
            kind = "leave" if r in self.left else "lost"
            self._event(rnd.key, kind, r, rnd.generation + 1, unix)
        self.leaves += len(gone)
        rnd.reopen(set(rnd.members) - set(gone))
        rnd.generation += 1

    def record(self, rnd: Round, alive: Callable[[int], bool], unix: float) -> None:
        """History and counts of step round ``rnd``, just decided."""
        for r in sorted(set(rnd.members) - rnd.before):
            self.joins += 1
            self._event(rnd.key, "join", r, rnd.generation, unix)
        for r in sorted(rnd.before - set(rnd.members)):
            self.leaves += 1
            kind = "leave" if r in self.left else "lost" if not alive(r) else "excluded"
            self._event(rnd.key, kind, r, rnd.generation, unix)
        self.steps_by_size[len(rnd.members)] += 1
        if self.last is None or rnd.key >= self.last.key:
            self.last = rnd

    def _event(self, step: int, kind: str, rank: int, generation: int, unix: float) -> None:
        kw = dict(step=step, kind=kind, rank=rank, unix=unix, generation=generation)
        self.history.append(pb.MembershipEvent(**kw))


def status_row(name: str, job: ElasticJob) -> pb.JobMembership:
    """Job ``name``'s row of the Status reply (``StatusReply.memberships``)."""
    last = job.last
    waiting = sorted({r for rnd in job.rounds.values() if not rnd.decided for r in rnd.announced})
    return pb.JobMembership(
        job=name,
        run=job.run,
        step=last.key if last else 0,
        generation=last.generation if last else 0,
        members=last.members if last else (),
        min_members=last.min_members if last else 0,
        joins=job.joins,
        leaves=job.leaves,
        revisions=job.revisions,
        steps_by_world_size={k: v for k, v in job.steps_by_size.items() if v > 0},
        history=list(job.history),
        waiting=waiting,
    )


def check_request(req: pb.JoinRequest) -> None:
    """Refuses a malformed request before anything changes."""
    for what, value in (("run", req.run), ("job", req.job)):
        if not value or len(value) > MAX_NAME:
            raise ShardError.invalid(f"Join needs a {what} name of 1..{MAX_NAME} characters")
    if not 1 <= req.world_size <= MAX_WORLD or req.rank >= req.world_size:
        raise ShardError.invalid(
            f"Join: rank {req.rank} of world size {req.world_size} (1..{MAX_WORLD} ranks)"
        )
    if req.min_members > req.world_size:
        raise ShardError.invalid(
            f"Join: min_members {req.min_members} is more than the world size {req.world_size}"
        )
    if req.window_ms > MAX_WINDOW_MS:
        raise ShardError.invalid(f"Join: window_ms must be at most {MAX_WINDOW_MS}")
    if len(req.known_members) > req.world_size or (
        max(req.known_members, default=-1) >= req.world_size  # one pass in C, not in Python
    ):
        raise ShardError.invalid(
            f"Join: known_members must be ranks below the world size {req.world_size}"
        )
    if req.done and not req.recovery:
        raise ShardError.invalid("Join: done is for recovery rounds")
    check_version(req.step, "step", "Join")  # its reply names the step after it
    check_epoch(req.epoch, "Join")


def other_run(job: ElasticJob, req: pb.JoinRequest, live: frozenset[int] | None) -> bool:
    """Whether ``req`` is a Join of another run (or world size) than ``job``'s while ranks of
    ``job``'s run hold leases on this server (``live``): it then waits. A rank of an earlier
    launch would otherwise replace the live run's record (its decided steps, generations),
    and the live ranks' pushes were refused; a new launch's ranks wait until the old run's
    leases lapse (its streams' end, a second after its processes die)."""
    return (job.run, job.world_size) != (req.run, req.world_size) and not req.leave and bool(live)


def check_share(
    jobs: Iterable[ElasticJob], owner: str | None, max_jobs: int, req: pb.JoinRequest
) -> None:
    """Refuses (RESOURCE_EXHAUSTED) a job more for a caller (its token) that made half of
    ``max_jobs`` of ``jobs`` already, so the teams sharing a server cannot take each other's
    place; None (no tokens): no share."""
    if owner is None:
        return
    owned = sum(1 for job in jobs if job.owner == owner)
    if owned >= max_jobs // 2:
        raise ShardError.exhausted(
            f"Join: this caller's token made {owned} of the elastic jobs this server"
            f" coordinates, its share (half of the server's {max_jobs}); job '{req.job}' was"
            " not added"
        )
