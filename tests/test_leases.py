"""Trainer leases and abort notices (server/collectives/leases.py, client/leases.py): a rank that
dies is noticed through the servers within seconds, not at a call deadline (its lease streams:
tests/test_liveness.py; here the renewals' TTL).

The table's rules are checked with a fake clock (no sleeping, no timing). The client's side of
the notices, and the end-to-end tests that kill a real rank process: tests/test_lease_notices.py.
"""

from __future__ import annotations

import grpc
import pytest
from lease_fakes import Clock, contribute

from paramshard.client import ClusterSpec, ShardClient
from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.lease_records import SETTLE_S
from paramshard.server.collectives.leases import ISOLATED_GRACE_S, LeaseTable
from paramshard.server.collectives.pending import run_epoch
from paramshard.server.collectives.slots import SlotStore
from paramshard.server.runtime.errors import ShardError


def lease(run="r", rank=0, world=2, epoch=0, ttl_ms=1000, **kw) -> pb.LeaseRequest:
    return pb.LeaseRequest(run=run, rank=rank, world_size=world, epoch=epoch, ttl_ms=ttl_ms, **kw)


def keep(leases: LeaseTable, clock: Clock, seconds: float, *ranks: int) -> pb.LeaseReply:
    """Moves the clock ``seconds`` on while ``ranks`` renew at the client's pace (0.4 s);
    returns the last reply (of the last rank)."""
    end = clock.now + seconds
    while True:
        clock.now = min(clock.now + 0.4, end)
        for rank in ranks:
            reply = leases.renew(lease(rank=rank))
        if clock.now >= end:
            return reply


@pytest.fixture
def table():
    clock = Clock()
    slots = SlotStore()
    return LeaseTable(slots, forget_s=60.0, clock=clock), slots, clock


def test_run_epoch_parses_every_key_form():
    assert run_epoch("r:all_reduce1", "r") == 0
    assert run_epoch("r/tp0:all_gather3", "r") == 0
    assert run_epoch("r.e2:barrier1", "r") == 2
    assert run_epoch("r/pp.e3:send1", "r") == 3
    assert run_epoch("r.e1/dp0:ar1", "r") == 1  # a group made after a restart
    assert run_epoch("r2:all_reduce1", "r") is None  # another run
    assert run_epoch("r.eval:x", "r") is None  # a run named "r.eval"
    assert run_epoch("q:r", "r") is None


def test_a_lapsed_lease_aborts_the_epoch_and_its_slots(table):
    leases, slots, clock = table
    leases.renew(lease(rank=0))
    leases.renew(lease(rank=1))
    contribute(slots, "r:all_reduce1", 0)  # waits for rank 1
    clock.now += 0.9
    assert not leases.renew(lease(rank=0)).aborted  # rank 1 is within its TTL still
    clock.now += 0.2  # rank 1 last renewed 1.1 s ago: lapsed
    reply = leases.renew(lease(rank=0))
    assert "rank 1 lost" in reply.aborted and reply.lost_rank == 1 and reply.aborted_epoch == 0
    with pytest.raises(ShardError) as ended:  # the open slot ended with the notice
        contribute(slots, "r:all_reduce1", 1)
    assert ended.value.code == grpc.StatusCode.ABORTED and "rank 1 lost" in ended.value.message
    with pytest.raises(ShardError) as refused:  # a slot of that epoch not open yet: refused
        contribute(slots, "r/dp:all_reduce2", 0)
    assert refused.value.code == grpc.StatusCode.ABORTED
    contribute(slots, "r.e1:barrier1", 0)  # the next epoch (recovery) is untouched
    assert not leases.renew(lease(rank=0, epoch=1)).aborted
    contribute(slots, "other:all_reduce1", 0)  # and so is every other run


def test_a_released_lease_aborts_nothing(table):
    leases, slots, clock = table
    leases.renew(lease(rank=0))
    leases.renew(lease(rank=1))
    leases.renew(lease(rank=1, release=True))
    clock.now += 5
    assert not leases.renew(lease(rank=0)).aborted
    contribute(slots, "r:all_reduce1", 0)


def test_a_rank_that_may_restart_is_awaited_then_given_up(table):
    leases, slots, clock = table
    leases.renew(lease(rank=0))
    leases.renew(lease(rank=1, rejoin_ms=10_000))
    reply = keep(leases, clock, 2, 0)
    assert not reply.aborted and list(reply.awaiting) == [1]
    leases.renew(lease(rank=1, rejoin_ms=10_000))  # its restart renews the same rank
    reply = leases.renew(lease(rank=0))
    assert not reply.aborted and not reply.awaiting
    # lapsed again (1 s after that renewal); this time no restart comes within 10 s
    reply = keep(leases, clock, 10.8, 0)
    assert not reply.aborted and list(reply.awaiting) == [1]
    reply = keep(leases, clock, 0.4, 0)
    assert "then 10 s for a restart" in reply.aborted and reply.lost_rank == 1


def test_an_abort_request_ends_the_epoch_for_every_rank(table):
    leases, slots, _ = table
    leases.renew(lease(rank=0))
    leases.renew(lease(rank=1))
    reply = leases.renew(lease(rank=1, abort="recovers: server 2 unreachable"))
    assert reply.aborted == "run 'r': rank 1 recovers: server 2 unreachable"  # one prefix
    assert reply.lost_rank == -1  # a recovery, not a lost rank
    assert "rank 1 recovers" in leases.renew(lease(rank=0)).aborted
    assert not leases.renew(lease(rank=0, epoch=1)).aborted


def test_a_run_id_reused_after_its_ranks_are_gone_starts_afresh(table):
    leases, slots, clock = table
    leases.renew(lease(rank=0))
    leases.renew(lease(rank=1))
    assert keep(leases, clock, 2, 0).aborted
    assert keep(leases, clock, 1, 0).aborted  # the survivor keeps hearing it while it renews
    leases.renew(lease(rank=0, release=True))
    # a new run under the same id (another world size even): no notice, its slots open
    assert not leases.renew(lease(rank=0, world=3)).aborted
    contribute(slots, "r:all_reduce1", 0, expected=3)


@pytest.mark.parametrize(
    ("restarted", "world", "launch", "told"),
    [
        (True, 2, "A", True),
        (True, 2, "", True),
        (False, 2, "A", False),
        (True, 3, "A", False),
        (True, 2, "B", False),
    ],
    ids=[
        "a-restart",
        "a-restart-of-an-older-client",
        "a-new-job",
        "a-restart-of-another-world",
        "a-restart-of-another-launcher",
    ],
)
def test_a_restart_meets_the_final_notice_of_a_run_whose_ranks_all_died(
    table, restarted, world, launch, told
):
    """Every rank of a run died at once, and one's launcher, out of restarts, posted the run's
    final notice for it. Another rank's restart (its launcher counts it: ``restarted``) gets
    that notice, and stops; before, no rank being alive, it started a new run under the id and
    waited for peers that never come (a field check: 120 s, its deadline). A new job under the
    id (no restart count) starts afresh, as before, and so does a process of another world, and
    a restart by another launcher (``launch``: a new job run again under the id, one of whose
    ranks was restarted before any other leased, met the last job's notice; a review)."""
    leases, _, clock = table
    for rank in (0, 1):
        leases.renew(lease(rank=rank, holder=f"first-{rank}", client=1, launch="A"))
    clock.now += 5.0  # both died, no witness: nothing decided
    why = "failed with exit code 1: ValueError: bad batch"
    leases.renew(lease(rank=0, holder="launcher", release=True, abort=why, final=True))
    clock.now += SETTLE_S + 1.0
    reply = leases.renew(
        lease(
            rank=1,
            world=world,
            holder="next",
            client=1,
            fresh=True,
            restarted=restarted,
            launch=launch,
        )
    )
    if told:
        assert reply.final and reply.aborted == f"run 'r': rank 0 {why}", reply
    else:
        assert not reply.aborted, reply


def test_a_blip_after_a_recovery_keeps_the_run_and_a_new_job_replaces_it(table):
    """A run aborted once and recovered (epoch 1) loses every lease to a blip longer than the
    grace. The first rank back, a running client, keeps the run and its open slot (it used to
    start a new run and drop them: "aborted with no live lease left"); a client being made
    (``fresh``) in another process starts a new run, once none was heard for ``SETTLE_S``."""
    leases, slots, clock = table
    leases.renew(lease(rank=0))
    leases.renew(lease(rank=1))
    assert keep(leases, clock, 2, 0).aborted  # rank 1 lost: epoch 0 aborted
    for rank in (1, 0):  # rank 1 restarted, both at epoch 1
        leases.renew(lease(rank=rank, epoch=1))
    contribute(slots, "r.e1:ar1/0", 0)
    clock.now += 5.0  # the blip: both leases lapse (TTL 1 s), no witness
    assert not leases.renew(lease(rank=0, epoch=1)).aborted
    assert [x.key for x in slots.open_slots()] == ["r.e1:ar1/0"]
    clock.now += SETTLE_S + 30.0  # then the job died; another one is made under the id
    assert not leases.renew(lease(rank=0, holder="new", fresh=True)).aborted
    assert slots.open_slots() == []


def test_a_server_that_hears_from_no_rank_decides_nothing(table):
    """A link cut between this server and every trainer: all leases lapse together, so no
    rank is taken for lost (the server cannot tell whose silence it is); when renewals resume,
    one rank before the other, the run goes on with its slots untouched."""
    leases, slots, clock = table
    leases.renew(lease(rank=0))
    leases.renew(lease(rank=1))
    contribute(slots, "r:all_reduce1", 0)  # waits for rank 1
    clock.now += 5
    leases.sweep()
    assert not leases.renew(lease(rank=0)).aborted  # rank 0's channel reconnects first
    reply = keep(leases, clock, 2, 0)  # rank 1's a while later
    assert not reply.aborted and list(reply.awaiting) == [1]
    reply = keep(leases, clock, 2, 0, 1)
    assert not reply.aborted and not reply.awaiting
    contribute(slots, "r:all_reduce1", 1)  # the open slot completes


def test_a_rank_still_silent_after_the_others_came_back_is_lost(table):
    leases, _, clock = table
    leases.renew(lease(rank=0))
    leases.renew(lease(rank=1))
    clock.now += 5  # this server heard from nobody
    reply = keep(leases, clock, ISOLATED_GRACE_S - 0.4, 0)
    assert not reply.aborted
    reply = keep(leases, clock, 0.8, 0)  # rank 0 got through for ISOLATED_GRACE_S
    assert "rank 1 lost" in reply.aborted and reply.lost_rank == 1


def test_a_run_that_went_quiet_everywhere_is_forgotten(table):
    """No rank renews any more and none was witnessed lost (the whole job was killed): its
    leases go after ``forget_s``, the run after another ``forget_s``."""
    leases, _, clock = table
    leases.renew(lease(rank=0))
    leases.renew(lease(rank=1))
    clock.now += 30
    leases.sweep()
    assert len(leases._runs["r"].leases) == 2
    clock.now += 32  # 61 s after the leases lapsed
    leases.sweep()
    assert not leases._runs["r"].leases
    clock.now += 61
    leases.sweep()
    assert not leases._runs and leases._books.leases.total == 0


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (lease(run=""), "run id"),
        (lease(run="a:b"), "no ':' or '/'"),
        (lease(run="a/b"), "no ':' or '/'"),  # would read as run a's group b
        (lease(run="a.e1"), "'.e<digits>'"),  # as run a's epoch 1: its aborts reach a's slots
        (lease(run="x" * 300), "run id"),
        (lease(rank=2, world=2), "rank 2 of world size 2"),
        (lease(world=0), "world size 0"),
        (lease(ttl_ms=5), "ttl_ms"),
        (lease(rejoin_ms=10**9), "rejoin_ms"),
        (lease(abort="x" * 2000), "abort reason"),
        (lease(epoch=2**32 - 1), "epoch 4,294,967,295 is over"),  # its next epoch: 2**32
    ],
)
def test_bad_leases_are_refused_and_change_nothing(table, request_, words):
    leases, _, _ = table
    with pytest.raises(ShardError) as refused:
        leases.renew(request_)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.message
    assert not leases._runs


def test_a_run_id_the_servers_would_misread_is_refused_by_client_and_server(servers):
    """A run id ending in an epoch's suffix, or with a group's separator, names another run's
    keys: the client refuses it when made, and a server its leases, saying so once."""
    (srv,) = servers(1, local_calls=False)
    with pytest.raises(ValueError, match=r"does not end in '\.e<digits>'"):
        ShardClient(ClusterSpec([srv.address]), rank=0, world_size=2, run_id="exp.e3")
    channel = grpc.insecure_channel(srv.address)
    try:
        stub = channel.unary_unary(
            "/paramshard.v1.Shard/Lease",
            request_serializer=pb.LeaseRequest.SerializeToString,
            response_deserializer=pb.LeaseReply.FromString,
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub(lease(run="exp/a"), timeout=10)
    finally:
        channel.close()
    words = refused.value.details()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words.startswith("Lease: a run id has no ':' or '/'"), words  # named once
    assert not srv.servicer.leases._runs


def test_two_live_runs_cannot_share_an_id(table):
    leases, _, _ = table
    leases.renew(lease(rank=0, world=2))
    with pytest.raises(ShardError) as refused:
        leases.renew(lease(rank=1, world=4))
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "two runs share the id" in refused.value.message


def test_leases_are_bounded(table):
    leases, _, _ = table
    leases.max_runs, leases.max_leases = 2, 3
    leases.renew(lease(run="a"))
    leases.renew(lease(run="b"))
    with pytest.raises(ShardError) as runs:
        leases.renew(lease(run="c"))
    assert runs.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    leases.renew(lease(run="a", rank=1))
    with pytest.raises(ShardError) as held:
        leases.renew(lease(run="b", rank=1))
    assert (
        held.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "3 leases" in held.value.message
    )
