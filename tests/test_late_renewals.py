"""A renewal that a rank sent before its lease stream ended, handled after the end
(server/collectives/leases.py, ``UNSEEN_END_S``): it keeps a dead rank's lease seconds, not a
TTL, and a live rank that saw its stream end keeps its lease. The table's rules with a fake
clock, then the race through gRPC, as tests/test_elastic.py met it on a busy machine. Last, a
renewal of an earlier epoch handled after the rank's renewal of the next one."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from conftest import unique_id
from lease_fakes import KILL_NOTICE_S, Stream, contribute, keep, lease, new_table

from paramshard.client import ClusterSpec, ShardClient
from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.leases import STREAM_GRACE_S, UNSEEN_END_S
from paramshard.server.runtime.errors import ShardError


@pytest.fixture
def table():
    return new_table()


def test_a_renewal_sent_before_the_stream_ended_holds_the_lease_only_briefly(table):
    """A renewal that rank 1 sent just before it died reaches a busy server after its stream's
    end. It still claims the stream, so it holds the lease until ``UNSEEN_END_S`` after the end,
    not for its 30 s TTL; once the lease lapsed, no renewal that claims a stream brings it back
    (tests/test_elastic.py saw the TTL's 30 s outlast a 20 s join window on a busy CI machine)."""
    leases, clock = table
    mine = Stream(rank=1)
    leases.open_hold(lease(0), Stream(rank=0))
    leases.open_hold(lease(1, ttl_ms=30_000), mine)
    keep(leases, clock, 2, 0)
    assert leases.end_hold(mine)
    clock.now += 0.5
    leases.renew(lease(1, ttl_ms=30_000, stream=True))  # sent before the end, handled after
    assert not keep(leases, clock, UNSEEN_END_S - 1.0, 0).aborted  # past the 1 s grace
    reply = keep(leases, clock, 1.0, 0)
    assert reply.lost_rank == 1 and "rank 1 lost (its lease stream" in reply.aborted, reply
    leases.renew(lease(1, ttl_ms=30_000, stream=True))
    assert leases.live_ranks("r") == {0}


def test_a_live_rank_that_saw_its_stream_end_is_kept(table):
    """Rank 1's stream ends while it lives. Its renewals sent before it saw the end keep the
    lease while it opens a new stream; a rank the server refuses a new stream renews without
    claiming one and keeps its lease for its TTL, as before streams."""
    leases, clock = table
    leases.open_hold(lease(0), Stream(rank=0))
    stream = Stream(rank=1)
    leases.open_hold(lease(1, ttl_ms=30_000), stream)
    for back in ("a new stream", "renewals alone"):
        keep(leases, clock, 2, 0)
        assert leases.end_hold(stream)
        clock.now += 0.5
        leases.renew(lease(1, ttl_ms=30_000, stream=True))
        clock.now += 2.5  # past the 1 s grace: it saw the end, its next renewal comes
        if back == "a new stream":
            stream = Stream(rank=1)
            leases.open_hold(lease(1, ttl_ms=30_000), stream)
        else:
            leases.renew(lease(1, ttl_ms=30_000))
        assert not keep(leases, clock, 20, 0).aborted, back
        assert leases.live_ranks("r") == {0, 1}, back


def test_a_rank_that_dies_before_its_stream_is_up_is_lost_at_its_ttl(table):
    """Its renewals claim a stream that never reached the server: they hold its lease for their
    TTL, as renewals alone do, so its death is still found."""
    leases, clock = table
    leases.open_hold(lease(0), Stream(rank=0))
    leases.renew(lease(1, stream=True))  # a 2 s TTL
    assert leases.live_ranks("r") == {0, 1}
    reply = keep(leases, clock, 3, 0)
    assert reply.lost_rank == 1 and "no lease renewal for 2 s" in reply.aborted, reply
    leases.open_hold(lease(1, stream=True), Stream(rank=1))  # the flag means nothing on a stream
    assert leases.live_ranks("r") == {0, 1}


def test_a_renewal_that_outlives_its_rank_delays_the_notice_by_seconds_only(servers):
    """The race tests/test_elastic.py met on a busy machine, through gRPC: rank 1's renewing
    thread reads its renewals while the rank's streams are open; the rank dies (its streams
    end, nothing is released); that renewal reaches the server after the stream's end. Rank 0
    learns that rank 1 is lost within seconds all the same, not at the 30 s TTL."""
    (srv,) = servers(1)
    run, table = unique_id(), srv.servicer.leases
    ended, end_hold = threading.Event(), table.end_hold

    def seen(stream):  # the server's own handler, and a word to the test when it ran
        try:
            return end_hold(stream)
        finally:
            ended.set()

    table.end_hold = seen
    ranks = [
        ShardClient(ClusterSpec([srv.address]), rank=r, world_size=2, run_id=run) for r in (0, 1)
    ]
    try:
        holding = ranks[1].run_state.holding
        deadline = time.monotonic() + 30
        while 1 not in (table.live_ranks(run) or ()) and time.monotonic() < deadline:
            time.sleep(0.05)  # its stream is up on the server
        (late,) = holding.renewals().values()
        assert late.stream, "a rank with an open stream says so in its renewals"
        holding.released = True  # the process dies: no release is sent, its streams end
        holding.close_holds()
        assert holding.renewals() == {}, "nothing is renewed after the rank's end"
        assert ended.wait(30), "the server never saw the stream end"
        killed = time.monotonic()
        ranks[0].spec.channel(0).unary_unary(
            "/paramshard.v1.Shard/Lease",
            request_serializer=pb.LeaseRequest.SerializeToString,
            response_deserializer=pb.LeaseReply.FromString,
        )(late, metadata=ranks[0].spec.metadata(), timeout=10)
        while ranks[0].run_state.current() is None and time.monotonic() - killed < 30:
            time.sleep(0.05)
        learned = time.monotonic() - killed
        notice = ranks[0].run_state.current()
        assert notice is not None and notice.lost_rank == 1, notice
        print(f"the peer learned in {learned:.2f} s")
        assert learned < UNSEEN_END_S + KILL_NOTICE_S
    finally:
        for c in ranks:
            c.close()


def test_a_peer_that_came_after_the_lost_ranks_stream_opened_witnesses_its_end(table):
    """Rank 1's stream reaches the server before rank 0's first renewal; later the stream ends
    and rank 1 sends nothing more. Rank 0 was live all through that silence (its stream was
    heard until its end), so rank 1 is lost within a renewal of ``STREAM_GRACE_S``, not
    ``ISOLATED_GRACE_S`` after rank 0 came (the through-gRPC test above met this 10 s wait
    whenever rank 1's stream opened first)."""
    leases, clock = table
    mine = Stream(rank=1)
    leases.open_hold(lease(1, ttl_ms=30_000), mine)  # heard at its opening only
    clock.now += 0.5
    leases.renew(lease(0))  # rank 0's liveness begins after rank 1 was last heard
    keep(leases, clock, 2, 0)
    assert leases.end_hold(mine)
    reply = keep(leases, clock, STREAM_GRACE_S + 1.0, 0)
    assert reply.lost_rank == 1 and "rank 1 lost (its lease stream" in reply.aborted, reply


def test_a_renewal_of_an_earlier_epoch_handled_late_does_not_set_the_lease_back(table):
    """A busy server handles a rank's renewal of epoch 0 after its renewal of epoch 1 (the
    renewing thread does not wait for an earlier epoch's: client/lease_renewals.py). The lease
    keeps epoch 1, so rank 1's death that follows aborts epoch 1. Before, the late renewals
    set both leases back to epoch 0, already aborted: the death aborted nothing, and rank 0
    waited on its slot of epoch 1 for its client's timeout."""
    leases, clock = table
    mine, theirs = Stream(rank=0), Stream(rank=1)
    leases.open_hold(lease(0), mine)
    leases.open_hold(lease(1), theirs)
    assert leases.renew(lease(1, abort="recovers: server 2 unreachable")).aborted_epoch == 0
    for rank in (0, 1):  # both recover under epoch 1
        leases.renew(lease(rank, epoch=1, stream=True))
    leases.renew(lease(1, epoch=0, stream=True))  # rank 1's renewal of epoch 0, late
    contribute(leases.slots, "r.e1:all_reduce1", 0)  # waits for rank 1, which dies
    assert leases.end_hold(theirs)
    clock.now += 0.5
    leases.renew(lease(0, epoch=0, stream=True))  # rank 0's, later still: it saw the death
    clock.now += STREAM_GRACE_S
    leases.check("r")
    notice = mine.pushed[-1]
    assert notice.lost_rank == 1 and notice.aborted_epoch == 1, notice
    with pytest.raises(ShardError) as ended:  # the slot of epoch 1 ended with the notice
        contribute(leases.slots, "r.e1:all_reduce1", 1)
    assert ended.value.code == grpc.StatusCode.ABORTED and "rank 1 lost" in ended.value.message
