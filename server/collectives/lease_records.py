"""What a server keeps of one run's leases: each rank's lease (``LeaseRecord``), the run's
(``RunRecord``), and who vouches for a rank a stream lost (``Witnesses``). The checks a lease
request passes before anything changes: server/collectives/lease_requests.py; the rules that
use both: server/collectives/leases.py.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

from paramshard.protos import shard_pb2 as pb

__all__ = ["LeaseRecord", "Listener", "RunRecord", "Witnesses", "SETTLE_S"]

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
    launches: dict[int, str] = field(default_factory=dict)  # rank -> its launcher (``launch``)
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
