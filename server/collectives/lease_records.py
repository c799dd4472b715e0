"""What a server keeps of one run's leases, and the checks a lease request passes before
anything changes (server/collectives/leases.py holds the rules that use them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from paramshard.protos import shard_pb2 as pb
from paramshard.server.runtime.errors import ShardError

__all__ = ["LeaseRecord", "Listener", "RunRecord", "check_request", "witnessed"]

MAX_RUN_CHARS = 256
MAX_WORLD = 1 << 20
TTL_MS = (100, 600_000)
MAX_REJOIN_MS = 3_600_000
MAX_REASON_CHARS = 1024


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
    holds: int = 0  # its open streams
    closed_at: float | None = None  # when its last stream ended (None: open, or renewed since)
    lapsed_at: float | None = None  # when it lapsed, while the run waits for its rank

    def live(self, now: float) -> bool:
        return self.holds > 0 or self.expires >= now

    @property
    def last_alive(self) -> float:
        """The last moment this server knew its rank alive: its stream's end while a stream
        held it (an open stream is heard all along), else its last renewal or opening."""
        return self.closed_at if self.closed_at is not None else self.heard

    @property
    def silent_from(self) -> float:
        """When its silence began to count: its stream's end, else its TTL's."""
        return self.closed_at if self.closed_at is not None else self.expires


@dataclass
class RunRecord:
    world_size: int
    leases: dict[int, LeaseRecord] = field(default_factory=dict)
    aborted_epoch: int = -1
    reason: str = ""
    lost_rank: int = -1
    checked: float = 0.0
    idle_since: float | None = None  # when its last lease went
    lost: dict[int, float] = field(default_factory=dict)  # rank -> when its lapsed lease went
    streams: set[Listener] = field(default_factory=set)

    def live(self, now: float, but: int = -1) -> list[int]:
        return [r for r, x in self.leases.items() if r != but and x.live(now)]

    def notice(self, epoch: int) -> pb.LeaseReply:
        """The reply for a rank at ``epoch``: the notice if that epoch was aborted."""
        reply = pb.LeaseReply(lost_rank=-1)
        if self.aborted_epoch >= epoch:
            reply.aborted, reply.aborted_epoch = self.reason, self.aborted_epoch
            reply.lost_rank = self.lost_rank
        reply.awaiting.extend(sorted(r for r, x in self.leases.items() if x.lapsed_at))
        return reply


def witnessed(
    run: RunRecord, rank: int, silent: LeaseRecord, now: float, isolated_grace_s: float
) -> bool:
    """Whether another rank's renewals reached this server all through ``rank``'s silence
    (live since before ``rank`` was last known alive, or for ``isolated_grace_s`` since they
    resumed), one of them after the silence began: proof that the silence is the rank's, not
    this server's."""
    return any(
        other.live(now)
        and other.heard > silent.silent_from
        and (other.since <= silent.last_alive or now - other.since >= isolated_grace_s)
        for r, other in run.leases.items()
        if r != rank
    )


def check_request(req: pb.LeaseRequest) -> None:
    """Refuses a malformed request before anything changes."""
    if not req.run or len(req.run) > MAX_RUN_CHARS or ":" in req.run:
        raise ShardError.invalid(
            f"Lease needs a run id of 1..{MAX_RUN_CHARS} characters without ':',"
            f" got {req.run[:64]!r}{'...' if len(req.run) > 64 else ''}"
        )
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
