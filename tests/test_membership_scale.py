"""Elastic membership of runs of thousands of ranks (server/collectives/membership.py): each rank
Joins the coordinator at every step, so a step of W ranks is W Joins (and as many asked again
once the round is decided), and what deciding costs a Join must not grow with W.

Work is counted, not timed: how often the coordinator asks whether a rank is alive (a lookup
in the lease table's live set) per Join, at two run sizes. A Join still reads its request's
known members and a decided reply lists the step's members: those are O(W) a Join, in C.
"""

from __future__ import annotations

from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.membership import MembershipTable


class CountedSet(set):
    """The live ranks, counting the lookups."""

    lookups = 0

    def __contains__(self, rank: object) -> bool:
        CountedSet.lookups += 1
        return super().__contains__(rank)


class Leases:
    def __init__(self, world: int) -> None:
        self.world = world

    def live_ranks(self, run: str) -> set[int]:
        return CountedSet(range(self.world))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lookups_per_join(world: int) -> float:
    """A step's round of ``world`` ranks: each announces itself, then asks again once it is
    decided; the lookups of the live set per Join."""
    clock = Clock()
    table = MembershipTable(Leases(world), {"j": 0}.get, clock=clock)

    def join(rank: int) -> pb.JoinReply:
        clock.now += 1e-4  # W Joins within the round's window
        req = pb.JoinRequest(
            run="r", job="j", rank=rank, world_size=world, step=0, min_members=1,
            window_ms=60_000, known_members=range(world),
        )  # fmt: skip
        return table.join(req, 0.0)

    CountedSet.lookups = 0
    for rank in range(world):
        reply = join(rank)
        assert reply.decided == (rank == world - 1), (rank, reply)
    for rank in range(world):
        reply = join(rank)
        assert reply.decided and reply.member and len(reply.members) == world
    return CountedSet.lookups / (2 * world)


def test_a_join_asks_about_a_bounded_number_of_ranks_whatever_the_round_size():
    """Before, every Join of an undecided round asked about every expected and every announced
    rank (two sets built a Join: a step of 4,096 ranks took 6.7 s of the coordinator's CPU for
    its announcements). Now a round walks its expected ranks once over all its Joins, and looks
    at them all once more when it decides."""
    small, large = lookups_per_join(200), lookups_per_join(4000)
    assert large <= small * 1.25 + 2, (small, large)
    assert large < 10, large
