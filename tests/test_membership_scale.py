"""Elastic membership of runs of thousands of ranks (server/collectives/membership.py): each rank
Joins the coordinator at every step, so a step of W ranks is W Joins (and as many asked again
once the round is decided), and what deciding costs a Join must not grow with W.

Work is counted, not timed: how often the coordinator asks whether a rank is alive (a lookup
in the lease table's live set) per Join, and how often the lease table asks a lease, at two
run sizes. A request carries its rank's known members only when the coordinator asks for them
(a new job's first round), and an undecided reply lists at most 16 ranks; a decided reply
still lists the step's members, O(W) a Join in C.
"""

from __future__ import annotations

from lease_fakes import new_table

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


def a_step(table: MembershipTable, clock, world: int) -> None:
    """A step's round of ``world`` ranks, as their clients ask: each announces itself (the
    first sent again with its known members, as the coordinator asks), then asks again once it
    is decided."""

    def join(rank: int, known: bool = False) -> pb.JoinReply:
        clock.now += 1e-4  # W Joins within the round's window
        req = pb.JoinRequest(
            run="r", job="j", rank=rank, world_size=world, step=0, min_members=1,
            window_ms=60_000, known_members=range(world) if known else (),
        )  # fmt: skip
        reply = table.join(req, 0.0)
        return join(rank, known=True) if reply.send_known else reply

    for rank in range(world):
        reply = join(rank)
        assert reply.decided == (rank == world - 1), (rank, reply)
        assert reply.decided or len(reply.SerializeToString()) < 128  # at most 16 ranks listed
    for rank in range(world):
        reply = join(rank)
        assert reply.decided and reply.member and len(reply.members) == world


def lookups_per_join(world: int) -> float:
    """The lookups of the live set per Join of a step of ``world`` ranks."""
    clock = Clock()
    table = MembershipTable(Leases(world), {"j": 0}.get, clock=clock)
    CountedSet.lookups = 0
    a_step(table, clock, world)
    return CountedSet.lookups / (2 * world)


def lease_asks_per_join(world: int, lease_asks: list[int]) -> float:
    """The asks of a lease (``LeaseRecord.live``) per Join of a step of ``world`` ranks that
    hold leases on the coordinator: the real lease table answers the live ranks."""
    leases, clock = new_table()
    for rank in range(world):
        leases.renew(pb.LeaseRequest(run="r", rank=rank, world_size=world, ttl_ms=30_000))
    table = MembershipTable(leases, {"j": 0}.get, clock=clock)
    lease_asks[0] = 0
    a_step(table, clock, world)
    return lease_asks[0] / (2 * world)


def test_a_join_asks_about_a_bounded_number_of_ranks_whatever_the_round_size():
    """Before, every Join of an undecided round asked about every expected and every announced
    rank (two sets built a Join: a step of 4,096 ranks took 6.7 s of the coordinator's CPU for
    its announcements). Now a round walks its expected ranks once over all its Joins, and looks
    at them all once more when it decides."""
    small, large = lookups_per_join(200), lookups_per_join(4000)
    assert large <= small * 1.25 + 2, (small, large)
    assert large < 10, large


def test_the_live_ranks_are_walked_once_a_step_not_once_a_join(lease_asks):
    """Before, the lease table listed the run's live leases for each Join (W asks a Join, and a
    set of W ranks built). Now it keeps the set until a lease may have come or gone
    (``RunRecord.live_set``): the step's Joins ask each lease about once in all."""
    small, large = lease_asks_per_join(200, lease_asks), lease_asks_per_join(4000, lease_asks)
    assert large <= small * 1.25 + 1, (small, large)
    assert large < 2, large
