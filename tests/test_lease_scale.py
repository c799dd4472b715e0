"""Leases of runs of thousands of ranks (server/collectives/leases.py): every rank renews on
every server each second, so a server of a run of W ranks handles W renewals a second, and what
one renewal costs must not grow with W.

Work is counted, not timed: how often the table asks a lease whether it is live
(``LeaseRecord.live``) per renewal, at two run sizes, on a fake clock that moves at the
renewals' pace (W renewals a second, as W ranks renewing once a second send them).
``python -m benchmarks.leases`` measures the time. The ranks' side: in a run of more than
``RENEWALS_A_SECOND`` ranks each rank renews a server less often (client/lease_keeper.py).
"""

from __future__ import annotations

import random
import threading
import time

from conftest import unique_id
from lease_fakes import Stream, new_table

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.lease_keeper import RENEW_S, RENEWALS_A_SECOND, renewal_pace
from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.lease_records import LeaseRecord, RunRecord, Witnesses
from paramshard.server.collectives.leases import ISOLATED_GRACE_S, STREAM_GRACE_S


def lease(rank: int, world: int, ttl_ms: int = 30_000) -> pb.LeaseRequest:
    return pb.LeaseRequest(run="big", rank=rank, world_size=world, ttl_ms=ttl_ms)


def asks_per_renewal(world: int, lease_asks: list[int]) -> float:
    """Registers ``world`` ranks, then counts the lease asks of one second of renewals."""
    leases, clock = new_table()
    for rank in range(world):
        leases.renew(lease(rank, world))
    lease_asks[0] = 0
    for rank in range(world):
        clock.now += 1.0 / world
        reply = leases.renew(lease(rank, world))
        assert not reply.aborted and not reply.awaiting
    return lease_asks[0] / world


def test_a_renewal_costs_the_same_in_a_run_25_times_larger(lease_asks):
    """Before, each renewal asked every other lease of the run (a run of 8,192 ranks took 7.8 s
    of a server's CPU for one second of its renewals). The lapse checks still walk the run,
    at most 20 times a second, which a run's W renewals a second share."""
    small, large = asks_per_renewal(200, lease_asks), asks_per_renewal(5000, lease_asks)
    assert large <= small * 1.25 + 2, (small, large)
    assert large < 40, large  # 20 checks a second of W asks each, over W renewals, and a few


def test_a_server_cut_off_from_every_rank_asks_each_lease_a_bounded_number_of_times(lease_asks):
    """A server that heard from no rank for a TTL sees every lease silent at once. It decides
    nothing (no witness), and deciding that asks each lease a few times, not once per other
    lease (5,000 silent leases: 25 million asks before)."""
    world = 5000
    leases, clock = new_table()
    for rank in range(world):
        leases.renew(lease(rank, world))
    clock.now += 31
    lease_asks[0] = 0
    leases.sweep()
    run = leases._runs["big"]
    assert run.aborted_epoch == -1 and len(run.awaiting) == world
    assert lease_asks[0] <= 4 * world, lease_asks[0]
    reply = leases.renew(lease(0, world))  # the link is back: ranks are awaited, not lost
    assert not reply.aborted and list(reply.awaiting) == list(range(1, world))


def witnessed_by_the_rule(run: RunRecord, rank: int, now: float) -> bool:
    """The rule as stated (``Witnesses``), lease by lease."""
    silent = run.leases[rank]
    return any(
        other.live(now)
        and other.heard > silent.silent_from
        and (other.since <= silent.last_alive or now - other.since >= ISOLATED_GRACE_S)
        for r, other in run.leases.items()
        if r != rank
    )


def random_run(rng: random.Random, now: float, world: int) -> RunRecord:
    """Leases at random points of their lives: open or closed streams, renewed or not."""
    run = RunRecord(world_size=world)
    for rank in range(world):
        since = now - rng.uniform(0, 30)
        heard = rng.uniform(since, now)
        closed = rng.choice([None, rng.uniform(since, now)])
        expires = rng.uniform(now - 10, now + 10) if closed is None else closed + 1.0
        record = LeaseRecord(expires, 0, 30.0, 0.0, since, heard, closed_at=closed)
        if rng.random() < 0.25:  # held by an open stream
            record.held_by.add(Stream(rank=rank))
        run.leases[rank] = record
    return run


def test_witnesses_answer_as_the_rule_for_every_silent_lease():
    rng, now = random.Random(7), 1000.0
    answers: list[bool] = []
    for _ in range(300):
        run = random_run(rng, now, rng.randint(2, 40))
        witnesses = Witnesses(run, now, ISOLATED_GRACE_S)
        for rank, record in run.leases.items():
            if not record.live(now):
                answer = witnesses.saw(record)
                assert answer == witnessed_by_the_rule(run, rank, now), (rank, record)
                answers.append(answer)
    assert answers.count(True) > 100 and answers.count(False) > 100  # both kinds were asked


def test_a_rank_of_a_large_run_renews_at_its_pace_and_at_once_on_a_new_epoch(servers):
    """A rank of a run of 256 renews a server where it holds a stream every 256 / 64 = 4 s, not
    every second: through a real server, the renewals the server's table takes are counted.
    Moving to a new epoch (recovery) renews at once, whatever the pace."""
    (srv,) = servers(1)
    table, run = srv.servicer.leases, unique_id()
    world = 4 * RENEWALS_A_SECOND
    took: list[tuple[float, int]] = []
    renew, lock = table.renew, threading.Lock()

    def counted(req, owner=None):
        if req.run == run:
            with lock:
                took.append((time.monotonic(), req.epoch))
        return renew(req, owner)

    table.renew = counted
    client = ShardClient(ClusterSpec([srv.address]), rank=0, world_size=world, run_id=run)
    try:
        holding = client.run_state.holding
        assert renewal_pace(world, holding.ttl_s, streamed=True) == 4.0
        deadline = time.monotonic() + 30
        while not (took and holding.holds.get(0) and holding.holds[0].open):
            assert time.monotonic() < deadline, "no renewal, or no stream, within 30 s"
            time.sleep(0.05)
        time.sleep(0.2)  # the first renewal's answer is taken
        start, before = time.monotonic(), len(took)
        time.sleep(5 * RENEW_S + 0.5)
        paced = [t for t, _ in took[before:] if t >= start]
        assert len(paced) <= 2, f"{len(paced)} renewals in 5.5 s at a 4 s pace"
        assert holding.renewals(paced=False), "asked all at once (refresh) it renews"
        client.restart_collectives(1)  # the next epoch: the server hears it at once
        deadline = time.monotonic() + 3 * RENEW_S
        while not any(epoch == 1 for _, epoch in took):
            assert time.monotonic() < deadline, "the new epoch was not renewed within 3 s"
            time.sleep(0.05)
    finally:
        client.close()
        table.renew = renew


def test_the_kept_live_set_follows_every_way_a_lease_comes_and_goes():
    """``live_ranks`` answers the same set object while no lease may have come or gone
    (``RunRecord.live_set``); each way one does is seen at once."""
    leases, clock = new_table()

    def live() -> frozenset[int]:
        return leases.live_ranks("big")

    for rank in (0, 1):
        leases.renew(lease(rank, 8, ttl_ms=1_000))
    kept = live()
    clock.now += 0.5
    assert live() is kept == {0, 1}  # nothing moved: the same set
    leases.renew(lease(2, 8, ttl_ms=1_000))  # a new lease
    assert live() == {0, 1, 2}
    leases.renew(pb.LeaseRequest(run="big", rank=1, world_size=8, release=True))  # released
    assert live() == {0, 2}
    leases.renew(lease(2, 8, ttl_ms=200))  # a renewal shortens its lease
    clock.now += 0.3
    assert live() == {0}  # rank 2's shorter lease ran out first
    clock.now += 0.3  # past rank 0's TTL, no renewal: expired (not yet found lapsed)
    assert live() == set()
    leases.renew(lease(0, 8, ttl_ms=1_000))  # back before its lapse was found
    assert live() == {0}
    stream = Stream("big", rank=3)
    leases.open_hold(lease(3, 8, ttl_ms=100), stream)
    clock.now += 0.9  # a stream holds it past its TTL
    assert live() == {0, 3}
    assert leases.end_hold(stream)  # its stream ended: STREAM_GRACE_S to come back
    clock.now += 0.5
    assert live() == {3}  # rank 0 expired, rank 3 within its grace
    clock.now += 0.6
    assert live() == set()
    leases.renew(lease(0, 8, ttl_ms=30_000))  # a long lease: the kept set's bound is far off
    stream = Stream("big", rank=4)
    leases.open_hold(lease(4, 8, ttl_ms=30_000), stream)
    assert live() == {0, 4}
    assert leases.end_hold(stream)
    clock.now += STREAM_GRACE_S + 0.1
    assert live() == {0}  # rank 4's stream ended and its grace ran out, long before 30 s
    claims = pb.LeaseRequest(run="big", rank=4, world_size=8, ttl_ms=30_000, stream=True)
    leases.renew(claims)  # sent before it saw its stream end
    assert live() == {0, 4}  # held until UNSEEN_END_S after the end (test_late_renewals.py)
