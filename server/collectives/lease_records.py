"""What a server keeps of one run's leases, and the checks a lease request passes before
anything changes (server/collectives/leases.py holds the rules that use them).

One process a rank: each request names its process and its client in the process
(``LeaseRequest.holder``, ``client``). While a rank's lease is held through an open stream,
another process's requests for it are refused with ALREADY_EXISTS (``check_holder``): two jobs
under one run id would otherwise sum into each other's slots. A restarted trainer takes the
rank over once the old process's streams ended. A client's requests that come late change
nothing: a release once the process's next client holds the rank (``superseded``), a renewal
or stream once the client released (``released_before``). A client being made in a process new
to a run in which no live process is behind any lease starts a new run (``abandoned``: a killed
job run again), once the server has heard from none of its ranks for ``SETTLE_S``
(``check_settled``).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Protocol

from paramshard.protos import shard_pb2 as pb
from paramshard.protos.run_ids import run_id_problem
from paramshard.server.collectives.gone_keys import of_run
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.request_bounds import check_epoch

__all__ = [
    "LeaseRecord",
    "Listener",
    "RunRecord",
    "Witnesses",
    "SETTLE_S",
    "abandoned",
    "check_holder",
    "check_request",
    "check_settled",
    "ended_run",
    "released_before",
    "superseded",
]

MAX_WORLD = 1 << 20
TTL_MS = (100, 600_000)
MAX_REJOIN_MS = 3_600_000
MAX_REASON_CHARS = 1024
MAX_HOLDER_CHARS = 256
SETTLE_S = 8.0
"""How long a server must have heard from none of a run's ranks before a process new to the
run starts a new one in its place (``abandoned``). A blip that resets every stream to this
server at once reads as every rank dead until their clients come back: the next renewal
after a broken stream goes within a second (client/leases.py, ``RENEW_S``), over a channel
that tries again after its backoff (at most 5 s and some jitter, client/cluster.py). A rule of
thumb, not a bound: an outage of several seconds can outlast it, and then reads as a killed
job. A killed job run again at once waits this long (its clients ask again for longer:
client/leases.py, ``TAKEOVER_S``)."""


class Listener(Protocol):
    """An open stream that is told the run's notices (lease_holds.Hold)."""

    run: str
    rank: int

    def push(self, reply: pb.LeaseReply) -> None: ...

    def stop(self) -> None: ...


@dataclass
class LeaseRecord:
    expires: float  # when it lapses while no stream holds it
    epoch: int
    ttl_s: float
    rejoin_s: float
    since: float  # when its current unbroken run of liveness began
    heard: float  # its last renewal or stream opening
    held_by: set[Listener] = field(default_factory=set)  # the open streams that hold it
    closed_at: float | None = None  # when its last stream ended (None: open, or renewed since)
    lapsed_at: float | None = None  # when it lapsed, while the run waits for its rank
    holder: str = ""  # the process that renewed or held it last (empty: an older client)
    reheard: bool = False  # renewed since its last stream ended, no stream since (alive)
    client: int = 0  # which client of that process (0: an older client)

    @property
    def holds(self) -> int:
        """Its open streams: those opened for it, not those of a lease its rank released (a
        closed client's stream that ends after the next client leased the rank)."""
        return len(self.held_by)

    def live(self, now: float) -> bool:
        return bool(self.held_by) or self.expires >= now

    @property
    def last_alive(self) -> float:
        """The last moment this server knew its rank alive: its stream's end while a stream
        held it (an open stream is heard all along), else its last renewal or opening."""
        return self.closed_at if self.closed_at is not None else self.heard

    @property
    def silent_from(self) -> float:
        """When its silence began to count: its stream's end, else its TTL's."""
        return self.closed_at if self.closed_at is not None else self.expires

    def lost_why(self) -> str:
        """How its rank was lost, for the abort's reason: its stream closed or its renewals
        stopped, and the wait for a restart when there was one."""
        waited = f", then {self.rejoin_s:g} s for a restart" if self.rejoin_s else ""
        if self.closed_at is not None:
            how = "its lease stream to this server closed: its process ended or its host is"
            return f"{how} unreachable{waited}"
        return f"no lease renewal for {self.ttl_s:g} s{waited}"


@dataclass
class RunRecord:
    """One run's leases. A renewal costs the same whatever the run's size: nothing a renewal
    does walks the run's leases (a run of 8,192 ranks renews 8,192 times a second on every
    server), only the lapse checks do, at most every ``CHECK_EVERY_S``."""

    world_size: int
    owner: str | None = None  # the caller (token) whose renewal made it: its share counts it
    leases: dict[int, LeaseRecord] = field(default_factory=dict)
    aborted_epoch: int = -1
    reason: str = ""
    lost_rank: int = -1
    final: bool = False  # the abort applies at every epoch: the run cannot go on
    checked: float = 0.0
    idle_since: float | None = None  # when its last lease went
    lost: dict[int, float] = field(default_factory=dict)  # rank -> when its lapsed lease went
    streams: set[Listener] = field(default_factory=set)
    awaiting: set[int] = field(default_factory=set)  # ranks whose lease lapsed, still kept
    released: set[int] = field(default_factory=set)  # ranks that released theirs: all = ended
    released_by: dict[int, tuple[str, int]] = field(default_factory=dict)  # rank -> its client
    released_at: dict[int, float] = field(default_factory=dict)  # rank -> when it released
    ended_at: dict[int, float] = field(default_factory=dict)  # the same, for good (``ends``)
    recent: int = -1  # the rank last renewed or found live: asked first by ``any_live``
    live_cache: frozenset[int] | None = None  # ``live_set``'s answer, until ``moved``
    live_until: float = 0.0  # the earliest a lease of ``live_cache`` can lapse untouched
    settling: tuple[float, frozenset[str]] | None = None  # refused to new jobs until; holders

    def live(self, now: float, but: int = -1) -> list[int]:
        return [r for r, x in self.leases.items() if r != but and x.live(now)]

    def live_set(self, now: float) -> frozenset[int]:
        """The ranks whose lease is live at ``now``: the same set object until a lease may have
        come or gone. An elastic job's coordinator asks it at each of a step's W Joins; walking
        the run each time made a step cost it O(W^2).

        A lease of the set without a stream lives at least until its ``expires`` (a renewal
        only moves that later); one held by a stream until the stream ends. Whatever else can
        change the set calls ``moved``: a lease made or back (``put``), gone (``pop``), its last
        stream ended, a renewal that brings back an expired lease or shortens one."""
        if self.live_cache is None or now > self.live_until:
            live, until = [], float("inf")
            for rank, lease in self.leases.items():
                if lease.live(now):
                    live.append(rank)
                    if not lease.holds:
                        until = min(until, lease.expires)
            self.live_cache, self.live_until = frozenset(live), until
        return self.live_cache

    def moved(self) -> None:
        """A lease may have come or gone otherwise than by lapsing: ``live_set`` looks again."""
        self.live_cache = None

    def any_live(self, now: float, but: int = -1) -> bool:
        """Whether a lease other than ``but``'s is live; the rank last known live is asked
        first, so a run whose ranks renew answers at once."""
        first = self.leases.get(self.recent)
        if self.recent != but and first is not None and first.live(now):
            return True
        for rank, lease in self.leases.items():
            if rank != but and lease.live(now):
                self.recent = rank
                return True
        return False

    def lapse(self, rank: int, lease: LeaseRecord) -> None:
        """``rank``'s lease lapsed (at its expiry); the run waits for the rank or loses it."""
        if lease.lapsed_at is None:
            lease.lapsed_at = lease.expires
            self.awaiting.add(rank)

    def taken_over(self, req: pb.LeaseRequest) -> bool:
        """Whether ``req`` comes from another process than the one that last held its rank
        (its lease, or its release): a restart of the rank in this run."""
        lease = self.leases.get(req.rank)
        earlier = lease.holder if lease is not None else self.released_by.get(req.rank, ("",))[0]
        return bool(req.holder and earlier and earlier != req.holder)

    def put(self, rank: int, lease: LeaseRecord) -> None:
        """``lease`` is now ``rank``'s, live: a new one, or one back from a lapse."""
        self.leases[rank] = lease
        self.awaiting.discard(rank)
        self.recent = rank
        self.moved()

    def pop(self, rank: int) -> LeaseRecord | None:
        self.awaiting.discard(rank)
        self.moved()
        return self.leases.pop(rank, None)

    def unseen_end(self, req: pb.LeaseRequest, now: float, grace_s: float) -> bool:
        """Whether renewal ``req`` claims a stream that this server saw end: then it holds the
        lease at most until ``grace_s`` after the end (``UNSEEN_END_S`` in
        server/collectives/leases.py), and a lease that lapsed stays lapsed for that long (a
        new stream, or a renewal from a rank that knows its stream is gone, brings it back). A
        renewal that beat its rank's first stream here holds it."""
        if not req.stream:
            return False
        lease = self.leases.get(req.rank)
        if lease is None:  # went with its lapse just now, or never here
            return now - self.lost.get(req.rank, -grace_s) < grace_s
        if lease.holds or (lease.closed_at is None and lease.lapsed_at is None):
            return False
        if lease.lapsed_at is None:
            lease.expires = max(lease.expires, lease.closed_at + grace_s)
            self.moved()  # an expired lease not yet found lapsed may be live again
        return True

    def notice(self, epoch: int) -> pb.LeaseReply:
        """The reply for a rank at ``epoch``: the notice if that epoch was aborted."""
        reply = pb.LeaseReply(lost_rank=-1)
        if self.aborted_epoch >= epoch or self.final:
            reply.aborted, reply.aborted_epoch = self.reason, self.aborted_epoch
            reply.lost_rank, reply.final = self.lost_rank, self.final
        reply.awaiting.extend(sorted(self.awaiting))
        return reply


class Witnesses:
    """Whether another rank's renewals reached this server all through a rank's silence (live
    since before that rank was last known alive, or for ``isolated_grace_s`` since they
    resumed), one of them after the silence began: proof that the silence is the rank's, not
    this server's.

    Built once per lapse check from the run's live leases, then answered for each silent
    lease in O(log n): the live leases sorted by ``since`` with the latest ``heard`` up to each,
    and the latest ``heard`` of those live for ``isolated_grace_s``. A server cut off from
    every rank sees every lease silent at once, and asking each of them about every other one
    was quadratic in the run's size."""

    def __init__(self, run: RunRecord, now: float, isolated_grace_s: float) -> None:
        live = sorted((x.since, x.heard) for x in run.leases.values() if x.live(now))
        self._since = [since for since, _ in live]
        self._latest = list(accumulate((heard for _, heard in live), max))
        settled = bisect_right(self._since, now - isolated_grace_s)
        self._settled = self._latest[settled - 1] if settled else float("-inf")

    def saw(self, silent: LeaseRecord) -> bool:
        """Whether ``silent``'s silence was witnessed (a silent lease is never live, so no
        witness is ``silent`` itself)."""
        if self._settled > silent.silent_from:
            return True
        before = bisect_right(self._since, silent.last_alive)
        return bool(before) and self._latest[before - 1] > silent.silent_from


def check_request(req: pb.LeaseRequest) -> None:
    """Refuses a malformed request before anything changes."""
    problem = run_id_problem(req.run)
    if problem is not None:
        raise ShardError.invalid(f"Lease: {problem}")
    if not 1 <= req.world_size <= MAX_WORLD or req.rank >= req.world_size:
        raise ShardError.invalid(
            f"Lease: rank {req.rank} of world size {req.world_size} (1..{MAX_WORLD} ranks)"
        )
    if not req.release and not TTL_MS[0] <= req.ttl_ms <= TTL_MS[1]:
        raise ShardError.invalid(
            f"Lease: ttl_ms must be in {TTL_MS[0]}..{TTL_MS[1]}, got {req.ttl_ms}"
        )
    if req.rejoin_ms > MAX_REJOIN_MS:
        raise ShardError.invalid(f"Lease: rejoin_ms must be at most {MAX_REJOIN_MS}")
    if len(req.abort) > MAX_REASON_CHARS:
        raise ShardError.invalid(f"Lease: an abort reason is at most {MAX_REASON_CHARS} chars")
    if len(req.holder) > MAX_HOLDER_CHARS:
        raise ShardError.invalid(f"Lease: a holder is at most {MAX_HOLDER_CHARS} characters")
    check_epoch(req.epoch, "Lease")


def check_holder(run: RunRecord | None, req: pb.LeaseRequest, now: float) -> None:
    """Refuses ``req`` when another process holds its rank through an open stream, or renewed
    it since its last stream ended (a blip reset the stream; it opens another at once): two
    jobs share the run id, or the rank was started twice. Their collectives would meet in the same
    slots, and a sum that mixes two jobs' gradients fails nowhere, so the second one is told
    instead (ALREADY_EXISTS), before anything changes: the first one's lease, epoch and run go
    on untouched. A holder whose streams all ended (its process died) is replaced: that is a
    restart. A request without a holder (an older client) is refused by a named holder's
    stream too (it would release the rank or start a new run in its place), but it does not
    refuse others. The message shows a holder without its random part (``holder_id`` in
    client/lease_holds.py), which another process would need to pass for it."""
    lease = run.leases.get(req.rank) if run is not None else None
    if lease is None or not lease.holder:
        return
    # renewed lately (a client whose stream broke renews every second until its next opens)
    renewed = lease.reheard and lease.closed_at is None and now - lease.heard < SETTLE_S
    if lease.holder != req.holder and (lease.holds or renewed):
        how = "through an open lease stream" if lease.holds else "renewing it (its stream broke)"
        raise ShardError.conflict(
            f"Lease: rank {req.rank} of run '{req.run}' is held by another process"
            f" ({_shown(lease.holder)}) {how}; this one is"
            f" {_shown(req.holder) or 'unnamed (an older client)'}. Two"
            " jobs share the run id (give each its own PARAMSHARD_RUN), or the rank was"
            " started twice. (A host that vanished holds its stream until this server's TCP"
            " user timeout ends it.)"
        )


def _shown(holder: str) -> str:
    return holder.rsplit(" ", 1)[0]


def released_before(run: RunRecord | None, req: pb.LeaseRequest) -> bool:
    """Whether renewal or stream ``req`` comes from a client that released its rank's lease
    here already: sent before the release, it came after. It holds nothing: a lease made from
    it would keep an ended run from being forgotten (the next run would meet its keys), or,
    held by a stream its client is closing, lapse and abort a run that goes on. Not late: an
    abort (the run's notice, a rank's to post whenever it can), and a release that says the
    rank ended for good (``ends``), which a client that closed before its process's exit sends
    at that exit (client/leases.py, ``_end_closed``): news its first release could not carry."""
    if req.abort or (req.release and req.ends):
        return False
    if run is None or not req.holder or not req.client:  # an older client: not told apart
        return False
    return run.released_by.get(req.rank) == (req.holder, req.client)


def ended_run(name: str, run: RunRecord, slots: Any) -> bool:
    """Whether run ``name``, whose leases are all gone, ended: every rank released its lease,
    or some did and nothing of the run waits in a slot of ``slots`` (an elastic job whose
    ranks never all ran). A rank that comes after its peers left, to read what they sent,
    finds its run still there."""
    if len(run.released) >= run.world_size:
        return True
    return bool(run.released) and not any(of_run(x.key, name) for x in slots.open_slots())


def abandoned(run: RunRecord, req: pb.LeaseRequest, now: float) -> bool:
    """Whether ``req`` comes from a client being made (``fresh``: a running rank never ends its
    own run) in a process new to run ``run`` (it holds none of its leases) while no lease of
    the run has a live process behind it: none held by an open stream or renewed since its
    last stream ended, and no rank awaited for a restart. That is a job whose ranks were all
    killed (a launcher that saw one rank die stops the others: nothing was released, and no
    rank lived on to witness a lapse), run again under its run id at once: a new run, or it
    would meet the old one's keys and open slots. A run whose ranks released theirs is left
    to ``ended_run``. Cheap for a rank's own renewals (its lease's holder is asked first), for
    a live run (its first live lease ends the walk) and while the run settles (its verdict is
    kept: the new job's clients ask again and again)."""
    if not req.fresh or not req.holder or req.release or not run.leases:
        return False
    if run.settling is not None and now < run.settling[0]:  # so found lately (check_settled)
        return req.holder not in run.settling[1]
    mine = run.leases.get(req.rank)
    if mine is not None and mine.holder == req.holder:
        return False
    return not any(
        lease.holds
        or (lease.closed_at is None and lease.expires >= now)
        or lease.holder == req.holder
        or (lease.rejoin_s > 0 and now - lease.expires < lease.rejoin_s)
        for lease in run.leases.values()
    )


def check_settled(run: RunRecord, req: pb.LeaseRequest, now: float) -> None:
    """Refuses ``req``, from a process new to abandoned run ``run``, while the server heard
    from one of its ranks less than ``SETTLE_S`` ago (ALREADY_EXISTS, which a new client asks
    again): they may be reconnecting, and a new run in its place would end their open slots.
    Nothing changes. The verdict is kept until the settle time ends (``RunRecord.settling``),
    so the new job's clients, asking again, do not each walk the run."""
    if run.settling is None or run.settling[0] <= now:
        quiet = now - max(lease.last_alive for lease in run.leases.values())
        if quiet >= SETTLE_S:
            return
        run.settling = (now + SETTLE_S - quiet, frozenset(x.holder for x in run.leases.values()))
    quiet = SETTLE_S - (run.settling[0] - now)
    raise ShardError.conflict(
        f"Lease: run '{req.run}' has no live rank on this server, but it heard from one"
        f" {quiet:.1f} s ago; a new job takes over the run id once it has heard from none"
        f" for {SETTLE_S:.0f} s (its ranks may be reconnecting). Ask again."
    )


def superseded(run: RunRecord, req: pb.LeaseRequest) -> bool:
    """Whether release ``req`` comes from another client than the one that renewed or held
    its rank's lease last: a closed client whose release, late on a loaded machine, reached
    this server after the same process's next client leased the rank. It drops nothing: the
    lease is the new client's, and counted as released it would end a run that goes on. So
    does a release without a holder (an older client) of a named process's lease."""
    lease = run.leases.get(req.rank)
    if lease is None or not lease.holder:  # an older client's: not told apart
        return False
    return (lease.holder, lease.client) != (req.holder, req.client)
