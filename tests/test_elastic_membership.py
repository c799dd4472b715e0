"""The coordinator's rounds (server/collectives/membership.py), step by step of its protocol.

A ``MembershipTable`` on a fake clock, fake leases and fake versions: every Join is answered at
once (``timeout`` 0), so each test walks the protocol's numbered steps and checks the replies,
the history and the counts the Status call shows. Through a real server: tests/test_elastic.py.
"""

from __future__ import annotations

import grpc
import pytest

from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives import rounds
from paramshard.server.collectives.membership import MembershipTable
from paramshard.server.runtime.errors import ShardError

WORLD = 4


class Leases:
    """Which ranks hold a live lease (None: the run is unknown, as on a fresh server)."""

    def __init__(self) -> None:
        self.live: set[int] | None = None

    def live_ranks(self, run: str) -> set[int] | None:
        return None if self.live is None else set(self.live)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def table() -> tuple[MembershipTable, Leases, Clock, dict[str, int]]:
    leases, clock, versions = Leases(), Clock(), {"j": 0}
    t = MembershipTable(leases, versions.get, clock=clock, wall=lambda: 1.0, max_jobs=2)
    return t, leases, clock, versions


def join(t: MembershipTable, rank: int, step: int = 0, **kw) -> pb.JoinReply:
    req = pb.JoinRequest(
        run=kw.pop("run", "r"),
        job=kw.pop("job", "j"),
        rank=rank,
        world_size=WORLD,
        step=step,
        min_members=kw.pop("min_members", 1),
        window_ms=kw.pop("window_ms", 5000),
        known_members=kw.pop("known", range(WORLD)),
        **kw,
    )
    return t.join(req, 0.0)


def history(t: MembershipTable) -> list[tuple[int, str, int]]:
    (row,) = t.status()
    return [(e.step, e.kind, e.rank) for e in row.history]


def test_a_round_waits_its_window_for_the_expected_ranks_then_takes_those_there(table) -> None:
    t, _, clock, _ = table
    for r in (0, 1, 2):
        reply = join(t, r)
        assert not reply.decided and reply.announced_count == r + 1
        assert reply.retry_after_ms == 100  # answered without waiting: ask again after a pause
        assert list(reply.announced) == []  # listed only below the minimum (a client's error)
    assert list(reply.expected) == [0, 1, 2, 3] and reply.expected_count == 4
    clock.now += 5.0  # the window (5 s) since the first expected rank came
    reply = join(t, 0)
    assert reply.decided and reply.member and list(reply.members) == [0, 1, 2]
    assert (reply.step, reply.generation, reply.leader) == (0, 0, 0)
    late = join(t, 3)  # after the decision: the next step (protocol step 3)
    assert late.decided and not late.member and late.next_step == 1
    assert history(t) == [(0, "join", 0), (0, "join", 1), (0, "join", 2)]


def test_every_expected_rank_there_decides_at_once(table) -> None:
    t, *_ = table
    for r in range(WORLD - 1):
        assert not join(t, r).decided
    reply = join(t, WORLD - 1)
    assert reply.decided and list(reply.members) == list(range(WORLD))


def test_a_joining_rank_waits_for_the_step_before_to_end_and_is_taken_in(table) -> None:
    t, _, clock, versions = table
    for r in range(3):
        join(t, r, known=range(3))
    assert join(t, 2, known=range(3)).decided  # step 0: ranks 0, 1, 2
    parked = join(t, 3, step=1)  # a new rank, for the next step: opens no window
    assert not parked.decided and list(parked.expected) == [0, 1, 2]
    clock.now += 60.0  # step 0 takes long: the joining rank alone never starts the window
    assert not join(t, 3, step=1).decided
    versions["j"] = 1  # step 0 applied; its members come
    for r in range(3):
        reply = join(t, r, step=1)
    assert reply.decided and list(reply.members) == [0, 1, 2, 3]
    assert (1, "join", 3) in history(t)
    (row,) = t.status()
    assert dict(row.steps_by_world_size) == {3: 1, 4: 1} and row.joins == 4


def test_a_member_lost_mid_step_revises_the_round_when_the_others_come_back(table) -> None:
    t, leases, _, _ = table
    leases.live = {0, 1, 2}
    for r in range(3):
        join(t, r, known=range(3))
    assert list(join(t, 0, known=range(3)).members) == [0, 1, 2]
    leases.live = {0, 1}  # rank 2's lease lapsed: the run's epoch 0 was aborted
    same = join(t, 1)  # a member in the round's own epoch only reads the decision
    assert same.generation == 0 and list(same.members) == [0, 1, 2]
    reopened = join(t, 0, epoch=1)  # back in a newer epoch: generation 1 without rank 2
    assert not reopened.decided and list(reopened.expected) == [0, 1]
    reply = join(t, 1, epoch=1)
    assert reply.decided and list(reply.members) == [0, 1]
    assert (reply.generation, reply.epoch) == (1, 1)
    assert history(t)[-1] == (0, "lost", 2)
    (row,) = t.status()
    assert row.revisions == 1 and row.leaves == 1 and dict(row.steps_by_world_size) == {2: 1}


def test_a_round_below_its_minimum_stays_open_and_says_so(table) -> None:
    t, leases, clock, _ = table
    leases.live = {0}
    first = join(t, 0, min_members=2, known=[0, 1])
    assert not first.decided and not first.below_min
    clock.now += 5.0  # the window passed: rank 1 never came, but one rank is not enough
    waiting = join(t, 0, min_members=2, known=[0, 1])
    assert not waiting.decided and waiting.below_min and list(waiting.announced) == [0]
    leases.live = {0, 3}
    reply = join(t, 3, min_members=2)
    assert reply.decided and list(reply.members) == [0, 3]


def test_a_step_already_applied_sends_the_rank_to_the_servers_step(table) -> None:
    t, _, _, versions = table
    versions["j"] = 7
    reply = join(t, 0, step=5)
    assert reply.decided and not reply.member and reply.next_step == 7
    with pytest.raises(ShardError, match="step 9 of job 'j' is ahead of the servers"):
        join(t, 0, step=9)


def test_leaving_drops_the_rank_and_says_whether_a_step_waits_for_it(table) -> None:
    t, _, _, versions = table
    for r in range(3):
        join(t, r, known=range(3))
    assert join(t, 0, known=range(3)).decided
    gone = join(t, 2, leave=True)
    assert gone.in_flight  # a member of step 0, not applied: the others must redo it
    versions["j"] = 1
    join(t, 0, step=1)
    join(t, 1, step=1)  # step 1 expects 0 and 1 only: rank 2 left
    assert list(join(t, 1, step=1).members) == [0, 1]
    assert join(t, 1, leave=True).in_flight  # a member of step 1, which waits for it
    versions["j"] = 2
    assert not join(t, 0, leave=True).in_flight  # its last step was applied


def test_recovery_round_has_one_leader_and_the_others_wait_for_it(table) -> None:
    t, leases, _, _ = table
    leases.live = {0, 1, 2}
    for r in range(3):
        join(t, r, known=range(3))
    join(t, 0, known=range(3))
    known = range(3)  # what each rank knew: step 0's members
    follower = join(t, 2, recovery=True, epoch=1, known=known)
    assert not follower.decided
    join(t, 1, recovery=True, epoch=1, known=known)
    leader = join(t, 0, recovery=True, epoch=1, known=known)
    assert leader.decided and leader.leader == 0 and not leader.done
    assert not join(t, 2, recovery=True, epoch=1, known=known).done
    leases.live = {1, 2}  # the leader died before restoring: the next one leads
    assert join(t, 2, recovery=True, epoch=1, known=known).leader == 1
    assert join(t, 1, recovery=True, epoch=1, known=known, done=True).done
    assert join(t, 2, recovery=True, epoch=1, known=known).done


def test_a_recovery_round_whose_members_are_all_lost_is_led_by_a_late_rank(table) -> None:
    """Rank 0 alone decides the round and leads it, rank 1 (restarted) comes after, and rank 0
    dies before restoring: rank 1 leads. Before, the dead rank 0 stayed the leader and rank 1
    waited for its ``done`` until its own bound (``elastic_wait_s``, 600 s; field review:
    a node down, then the other server killed during the recovery)."""
    t, leases, _, _ = table
    leases.live = {0}
    leader = join(t, 0, recovery=True, epoch=1, known=(0,))
    assert leader.decided and leader.leader == 0 and not leader.done
    leases.live = {0, 1}
    late = join(t, 1, recovery=True, epoch=1, known=(0, 1))
    assert late.decided and not late.member and late.leader == 0 and not late.done
    leases.live = {1}  # rank 0 died before restoring
    assert join(t, 1, recovery=True, epoch=1, known=(0, 1)).leader == 1
    assert join(t, 1, recovery=True, epoch=1, known=(0, 1), done=True).done


def test_a_leader_that_never_held_a_lease_here_is_replaced_once_unheard(table) -> None:
    """The coordinator restarted: rank 1 renewed its lease here, rank 0 only Joined, was named
    the recovery round's leader and died before renewing. It counts as alive for
    ``UNSEEN_S`` after its last Join, then rank 1 leads. Before, it counted as alive for good
    (never seen), and rank 1 waited for its ``done`` until ``elastic_wait_s`` (600 s)."""
    t, leases, clock, _ = table
    leases.live = {1}
    known = (0, 1)
    assert not join(t, 1, recovery=True, epoch=1, known=known).decided
    leader = join(t, 0, recovery=True, epoch=1, known=known)
    assert leader.decided and leader.leader == 0 and list(leader.members) == [0, 1]
    clock.now += rounds.UNSEEN_S - 1
    assert join(t, 1, recovery=True, epoch=1, known=known).leader == 0
    clock.now += 2  # rank 0 unheard for longer than UNSEEN_S, and rank 1 holds a lease here
    assert join(t, 1, recovery=True, epoch=1, known=known).leader == 1
    leases.live = {0, 1}  # a rank that renews after all is alive again
    assert join(t, 1, recovery=True, epoch=1, known=known).leader == 0


def test_a_rank_with_no_lease_here_counts_as_alive_while_it_joins_or_nobody_holds_one(
    table,
) -> None:
    """Unheard is gone only with a witness: a server that hears no lease of the run (None: it
    knows none; or every lease lapsed) may be cut off, and decides nothing on silence. A rank
    that keeps Joining (its lease refused here: the table full) stays alive."""
    t, leases, clock, _ = table
    known = (0, 1)
    join(t, 1, recovery=True, epoch=1, known=known)
    join(t, 0, recovery=True, epoch=1, known=known)
    clock.now += 10 * rounds.UNSEEN_S  # no lease of the run here at all
    assert join(t, 1, recovery=True, epoch=1, known=known).leader == 0
    leases.live = {1}
    for _ in range(4):  # rank 0 Joins (as a waiting rank asks again) within UNSEEN_S each time
        clock.now += rounds.UNSEEN_S / 2
        join(t, 0, recovery=True, epoch=1, known=known)
        assert join(t, 1, recovery=True, epoch=1, known=known).leader == 0
    leases.live = set()  # every lease lapsed: rank 1 (seen) is gone, rank 0 (never seen) not
    clock.now += 10 * rounds.UNSEEN_S
    assert join(t, 1, recovery=True, epoch=1, known=known).leader == 0


def test_bad_requests_are_refused_and_jobs_are_bounded(table) -> None:
    t, *_ = table
    cases = [
        ({"rank": 4}, "rank 4 of world size 4"),
        ({"min_members": 5}, "min_members 5 is more than the world size 4"),
        ({"window_ms": 4_000_000}, "window_ms must be at most"),
        ({"known": [0, 9]}, "known_members must be ranks below"),
        ({"done": True}, "done is for recovery rounds"),
        # found in review: the reply names the step after it (INTERNAL past uint64), and a
        # run's ranks take its epoch on and move on from it by one (past 32 bits)
        ({"step": 2**64 - 1}, "step 18,446,744,073,709,551,615 is over"),
        ({"epoch": 2**32 - 1}, "epoch 4,294,967,295 is over"),
    ]
    for kw, message in cases:
        rank = kw.pop("rank", 0)
        with pytest.raises(ShardError, match=message) as err:
            join(t, rank, **kw)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert t.status() == []  # nothing was added
    join(t, 0, job="a")
    join(t, 0, job="b")
    with pytest.raises(ShardError, match="coordinates 2 elastic jobs, its limit") as err:
        join(t, 0, job="c")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert t.drop("a") and not t.drop("a")
    join(t, 0, job="c")


def test_a_step_whose_members_are_all_gone_is_taken_by_whoever_comes(table) -> None:
    """The job's ranks finished or died while a rank waited for the next step: it is sent
    back to the servers' step, which it reopens and trains alone (a round is never decided
    ahead of the servers)."""
    t, leases, _, versions = table
    leases.live = {0, 1}
    join(t, 0, known=[0, 1])
    assert join(t, 1, known=[0, 1]).decided  # step 0: ranks 0 and 1
    waiting = join(t, 3, step=1)  # a new rank, for step 1: parked
    assert not waiting.decided
    leases.live = {3}  # ranks 0 and 1 die in step 0
    sent_back = join(t, 3, step=1)
    assert sent_back.decided and not sent_back.member and sent_back.next_step == 0
    reply = join(t, 3, step=0)  # not a member, but nobody is left: generation 1, alone
    assert reply.decided and reply.member and list(reply.members) == [3]
    assert reply.generation == 1
    versions["j"] = 1
    assert join(t, 3, step=1).decided


def test_a_step_reopened_below_its_minimum_takes_a_rank_parked_for_the_next(table) -> None:
    """The launch test's deadlock (tests/test_elastic_launch.py): a restarted rank came while
    step 0 was decided without it and was parked for step 1; then a member was lost, and step
    0, reopened without it, waited below its minimum for a rank that waited for step 1. The
    parked rank is sent back to the servers' step, which it completes."""
    t, leases, _, versions = table
    leases.live = {0, 1, 2}
    join(t, 0, min_members=2, known=[0, 2])
    assert list(join(t, 2, min_members=2, known=[0, 2]).members) == [0, 2]
    late = join(t, 1, min_members=2)  # the restarted rank 1, after the decision
    assert late.decided and not late.member and late.next_step == 1
    assert not join(t, 1, step=1, min_members=2).decided  # parked: step 0 is not applied
    leases.live = {0, 1}  # rank 2 dies in step 0: the epoch is aborted
    reopened = join(t, 0, epoch=1, min_members=2)  # generation 1 expects rank 0 alone
    assert not reopened.decided and reopened.below_min and list(reopened.announced) == [0]
    sent_back = join(t, 1, step=1, min_members=2)
    assert sent_back.decided and not sent_back.member and sent_back.next_step == 0
    reply = join(t, 1, epoch=1, min_members=2)
    assert reply.decided and reply.member and list(reply.members) == [0, 1]
    assert reply.generation == 1
    assert list(join(t, 0, epoch=1, min_members=2).members) == [0, 1]
    versions["j"] = 1  # step 0 applied: rank 1 announced step 1 already, so it is decided
    assert list(join(t, 0, step=1, epoch=1, min_members=2).members) == [0, 1]


def test_a_rank_that_starts_late_gets_the_runs_newest_epoch(table) -> None:
    """tests/test_elastic_chaos.py's seed 23: ranks 0 and 1 recovered from a lost rank into
    epoch 1 (epoch 0 aborted on the servers), finished and left; a rank started then, in epoch
    0, became the only member of the next step and kept epoch 0, so its next call was refused
    as aborted. The round gives it the run's newest epoch."""
    t, leases, _, versions = table
    leases.live = {0, 1}
    join(t, 0, epoch=1, known=[0, 1])
    assert join(t, 1, epoch=1, known=[0, 1]).epoch == 1
    versions["j"] = 1
    for r in (0, 1):
        assert join(t, r, epoch=1, leave=True).decided
    leases.live = {3}
    reply = join(t, 3, step=1)  # epoch 0: it never saw the abort
    assert reply.decided and reply.member and list(reply.members) == [3]
    assert reply.epoch == 1


def test_the_records_of_every_job_together_are_bounded() -> None:
    """Rounds that name many known members: a job of 65,536 ranks keeps 8 rounds, and the
    jobs' records together stay within MAX_SLOTS ranks (RESOURCE_EXHAUSTED beyond, which
    DropJob or the sweep makes room from). Found by a review: 700 such rounds took a server
    from 57 MB to 2.6 GB, uncounted by --max-memory."""
    world = rounds.MAX_WORLD
    t = MembershipTable(Leases(), {}.get, clock=Clock(), wall=lambda: 1.0)

    def big(job: str, step: int) -> pb.JoinReply:
        req = pb.JoinRequest(
            run="r", job=job, rank=0, world_size=world, step=step, min_members=world,
            window_ms=60_000, known_members=range(world),
        )  # fmt: skip
        return t.join(req, 0.0)

    for step in range(20):  # one job: its oldest rounds make room for the new ones
        assert not big("j0", step).decided
    kept = rounds.kept_rounds(world)
    assert kept == 8 and len(t._jobs["j0"].rounds) == kept  # noqa: SLF001 - the records
    made = 1
    with pytest.raises(ShardError, match="would pass its bound") as err:
        for made in range(1, 64):  # more jobs, each with its rounds, until the bound
            for step in range(kept):
                big(f"j{made}", step)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    held = sum(rounds.slots(j) for j in t._jobs.values())  # noqa: SLF001
    assert held <= rounds.MAX_SLOTS and made < 4
    with pytest.raises(ShardError, match="would pass its bound"):
        big("fresh", 0)
    assert t.drop("j0")
    assert not big("fresh", 0).decided  # room again


def test_a_coordinator_with_no_record_of_the_members_asks_for_them(table) -> None:
    """A client sends its known members only when asked (``send_known``): a round is opened
    from the step before's members, and only a new job, or a coordinator that restarted, has
    none. Asking changes no round."""
    t, _, _, versions = table
    asked = join(t, 1, known=())
    assert asked.send_known and not asked.decided
    (row,) = t.status()
    assert list(row.waiting) == []  # nobody announced
    opened = join(t, 1, known=[0, 1])  # the client asks again with them
    assert not opened.send_known and list(opened.expected) == [0, 1]
    assert join(t, 0, known=()).decided  # the round is open: no need to know
    versions["j"] = 1  # step 0 applied
    nxt = [join(t, r, step=1, known=()) for r in (0, 1)]  # step 1 expects step 0's members
    assert not any(r.send_known for r in nxt) and list(nxt[1].members) == [0, 1]
    assert join(t, 0, known=(), recovery=True, epoch=1).send_known  # a new recovery round


def test_a_join_of_another_run_waits_while_the_jobs_run_holds_leases(table) -> None:
    """Found in review: one Join of an earlier launch's run replaced the live run's record,
    and the live ranks' pushes of the step they were told were then refused. Now it is told
    to ask again later while the job's run holds leases here, and replaces the record once
    they lapsed (a new launch after the old one died)."""
    t, leases, _, _ = table
    leases.live = set(range(WORLD))
    for rank in range(WORLD):
        join(t, rank)
    stale = join(t, 0, run="old")
    assert not stale.decided and stale.retry_after_ms > 0
    ((row,),) = [t.status()]
    assert row.run == "r"  # the live run's record, untouched
    leases.live = set()  # its leases lapsed: a new launch takes the job over
    join(t, 0, run="new")
    assert [row.run for row in t.status()] == ["new"]
