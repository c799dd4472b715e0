"""What a server's leases may take of its memory: its runs, and the leases and the marks of
released ranks (``RunRecord.released``) of every run, counted against the server's bounds and,
where tokens are on, each caller's share of half of them, so that one team cannot take them
all (server/collectives/leases.py)."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from paramshard.protos import shard_pb2 as pb
from paramshard.server.runtime.errors import ShardError

if TYPE_CHECKING:
    from paramshard.server.collectives.lease_records import RunRecord

__all__ = ["Books", "Counted"]


class Counted:
    """Records of one kind (leases, marks of released ranks) held in all runs, and by the
    caller (token, where tokens are on) whose run holds them: past the server's bound, or a
    caller's share of half of it, no more are added, so one team cannot take them all."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.total = 0
        self.by_owner: dict[str, int] = {}

    def refusal(self, owner: str | None, limit: int) -> str | None:
        """Why one more of ``owner``'s would be refused under bound ``limit`` (None: room)."""
        if self.total >= limit:
            return f"this server holds {self.total} {self.what}, its limit"
        held = self.by_owner.get(owner, 0) if owner is not None else 0
        if owner is not None and held >= max(1, limit // 2):
            return (
                f"this caller's token holds {held} {self.what} on this server, its share"
                f" (half of the server's {limit})"
            )
        return None

    def add(self, owner: str | None, n: int = 1) -> None:
        self.total += n
        if owner is not None:
            self.by_owner[owner] = self.by_owner.get(owner, 0) + n

    def remove(self, owner: str | None, n: int = 1) -> None:
        self.total -= n
        if owner is not None and n:
            left = self.by_owner.pop(owner, 0) - n
            if left > 0:
                self.by_owner[owner] = left


class Books:
    """The leases and the marks of released ranks a server holds, counted against its bound
    (``max_leases`` of each) and, where tokens are on, each caller's share of half of it."""

    def __init__(self) -> None:
        self.leases = Counted("leases")
        self.marks = Counted("marks of released ranks")  # ``RunRecord.released``

    def room(self, owner: str | None, req: pb.LeaseRequest, limit: int) -> None:
        """Refuses a new lease of ``owner``'s run past the bound or the share."""
        why = self.leases.refusal(owner, limit)
        if why is not None:
            raise ShardError.exhausted(
                f"Lease: {why}; rank {req.rank} of run '{req.run}' was not added"
            )

    def room_for_run(
        self, runs: Collection[RunRecord], owner: str | None, req: pb.LeaseRequest, limit: int
    ) -> None:
        """Refuses run ``req.run``, new to a server holding ``runs``, past ``limit`` runs or,
        for a token's ``owner``, half of it (counted when asked: new runs are rare)."""
        if len(runs) >= limit:
            raise ShardError.exhausted(
                f"Lease: this server holds leases of {len(runs)} runs, its limit;"
                f" run '{req.run}' was not added"
            )
        owned = 0 if owner is None else sum(r.owner == owner for r in runs)
        if owner is not None and owned >= limit // 2:
            raise ShardError.exhausted(
                f"Lease: this caller's token holds leases of {owned} runs on this server,"
                f" its share (half of the server's {limit}); run '{req.run}' was not added"
            )

    def mark_released(self, run: RunRecord, req: pb.LeaseRequest, limit: int, now: float) -> None:
        """Marks ``req.rank`` released (all marked: the run ended), while marks fit; past
        them the run is forgotten ``forget_s`` after its last lease went, as unmarked."""
        if req.rank not in run.released:
            if self.marks.refusal(run.owner, limit) is not None:
                return
            self.marks.add(run.owner)
            run.released.add(req.rank)
        run.released_by[req.rank] = (req.holder, req.client)
        run.released_at[req.rank] = now
        if req.ends:
            run.ended_at[req.rank] = now
        else:
            run.ended_at.pop(req.rank, None)

    def forget(self, run: RunRecord) -> None:
        self.leases.remove(run.owner, len(run.leases))
        self.marks.remove(run.owner, len(run.released))
