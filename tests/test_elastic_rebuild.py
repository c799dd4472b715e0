"""An elastic job whose server restarted empty while a trainer restarted too (a node lost its
trainer and its server at once: the launcher restarts both). The restarted rank waits for the
running ranks to rebuild that server, then joins at their step (``ElasticSteps._await_rebuilt``;
before, it raised "on the servers at several versions [0, N]" and spent a restart: in a field
check 18 runs of 18), sits their recovery round out, and rebuilds the server itself when
nobody is left to. A server lost again after its restore starts a new recovery; a job nothing
holds any more is lost, said at once. Real in-process servers on 127.0.0.1; the rebuild is the
one the ranks' recovery makes (``recover_from_replicas``)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from test_elastic import BATCH, INIT, LR, data, net, vanish

from paramshard.client import ClusterSpec, ShardClient, ShardClientError, tools
from paramshard.protos import shard_pb2 as pb
from paramshard.strategies import FSDPModel, FSDPOptimizer, JobLost, ShardingConfiguration

pytestmark = pytest.mark.timeout(300)
JOB, STEPS = "rebuilt", 2


def rank(
    addresses: list[str], r: int, window_s: float = 10.0
) -> tuple[ShardClient, FSDPModel, FSDPOptimizer]:
    client = ShardClient(
        ClusterSpec(addresses), rank=r, world_size=2, run_id="rb", timeout_s=60, retries=2
    )
    config = ShardingConfiguration(
        client, job=JOB, elastic=True, replicate_every=1, join_window_s=window_s
    )
    model = FSDPModel(net(INIT), config, wrap=(torch.nn.Linear,))
    opt = FSDPOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), config)
    return client, model, opt


def replicated(client: ShardClient) -> None:
    """Until server 0 holds server 1's slices at version ``STEPS``: replicas travel after each
    step, in the background, and a rebuild goes back to the newest one every server has."""
    deadline = time.monotonic() + 60
    while True:
        got = client.call(0, "ListReplicas", pb.ListReplicasRequest(job=JOB))
        if any(r.source_index == 1 and r.version == STEPS for r in got.replicas):
            return
        assert time.monotonic() < deadline, f"server 1's step {STEPS} never reached server 0"
        time.sleep(0.05)


def one_step(model: FSDPModel, opt: FSDPOptimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One step on this rank's part of the global batch ``x``, ``y``; its loss."""
    part = model.batch_part(BATCH)
    loss = torch.nn.functional.mse_loss(model(x[part]), y[part])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def train(model: FSDPModel, opt: FSDPOptimizer) -> None:
    """``STEPS`` steps, this rank's part of each global batch."""
    x, y = data()
    for s in range(STEPS):
        one_step(model, opt, x[s], y[s])


@contextlib.contextmanager
def server_1_emptied(
    servers: Any, window_s: float = 10.0
) -> Iterator[tuple[list, ShardClient, FSDPModel]]:
    """Rank 0 trains ``STEPS`` steps alone, its replica reaches server 0, then server 1 is
    restarted empty: (the servers, rank 0's client, its model); the client closes after."""
    nodes = servers(2)
    client0, model0, opt0 = rank([s.address for s in nodes], 0, window_s)
    try:
        train(model0, opt0)
        replicated(client0)
        client0.call(1, "DropJob", pb.DropJobRequest(job=JOB))  # server 1 restarted empty
        yield nodes, client0, model0
    finally:
        client0.close()


def rank_1_comes(nodes: list, window_s: float, joined: list[object]) -> threading.Thread:
    """Starts rank 1 (a thread; its step count, or what it raised, goes to ``joined``) and
    returns once its registration reached server 1: it then waits for the rebuild."""
    addresses = [s.address for s in nodes]

    def comes() -> None:
        try:
            client1, model1, _ = rank(addresses, 1, window_s)
            joined.append(model1.step_count)
            client1.close()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            joined.append(exc)

    newcomer = threading.Thread(target=comes, name="r1")
    newcomer.start()
    deadline = time.monotonic() + 60
    while JOB not in nodes[1].servicer.buffers.jobs():
        assert time.monotonic() < deadline and newcomer.is_alive(), joined
        time.sleep(0.05)
    return newcomer


def resync_raises(model: FSDPModel, settle_s: float, more: str) -> ShardClientError:
    """What ``model.resync(1, settle_s)`` raises, run in a thread given 30 s (it must end);
    ``more`` is said should it not."""
    got: list[object] = []

    def resyncs() -> None:
        try:
            got.append(model.resync(1, settle_s))
        except ShardClientError as exc:
            got.append(exc)

    looking = threading.Thread(target=resyncs, name="resync epoch 1", daemon=True)
    looking.start()
    looking.join(30)
    assert not looking.is_alive(), f"resync of epoch 1 still looks after 30 s{more}"
    (exc,) = got
    assert isinstance(exc, ShardClientError), exc
    return exc


def test_a_rank_that_comes_while_a_server_is_rebuilt_waits_and_joins(servers) -> None:
    joined: list[object] = []
    with server_1_emptied(servers) as (nodes, client0, model0):
        assert model0.step_count == STEPS  # rank 0 trained alone
        newcomer = rank_1_comes(nodes, 10.0, joined)
        time.sleep(1.5)  # several of its looks at the servers
        assert newcomer.is_alive(), f"the new rank did not wait for the rebuild: {joined}"
        assert tools.recover_from_replicas(client0, JOB) == STEPS  # the running rank rebuilds
        newcomer.join(60)
        assert not newcomer.is_alive() and joined == [STEPS], joined


def test_a_rank_restarted_with_its_server_sits_out_the_others_recovery_round(servers) -> None:
    """Ranks 0 and 1 train two steps; rank 1's process and server 1 die together (server 1
    comes back empty) and rank 1 comes back. Rank 0 recovers: its recovery round expects rank
    1, a member of the last step and alive again. The new rank 1 waits for the rebuild outside
    that round, so it says it sits the round out (``Membership.sit_out``): the round decides
    without waiting its window (30 s here). Before, it waited the whole window."""
    window = 30.0
    nodes = servers(2)
    addresses = [s.address for s in nodes]
    ranks = [rank(addresses, r, window) for r in range(2)]

    def trains(r: int) -> None:
        _, model, opt = ranks[r]
        train(model, opt)

    both = [threading.Thread(target=trains, args=(r,)) for r in range(2)]
    for t in both:
        t.start()
    for t in both:
        t.join(120)
    client0, model0, _ = ranks[0]
    joined: list[object] = []
    try:
        assert model0.step_count == STEPS and ranks[1][1].step_count == STEPS
        vanish(ranks[1][0])  # rank 1's process dies
        replicated(client0)
        client0.call(1, "DropJob", pb.DropJobRequest(job=JOB))  # server 1 restarted empty
        restarted = rank_1_comes(nodes, window, joined)
        time.sleep(1.0)  # its word to the coordinator
        began = time.monotonic()
        model0.restart_collectives(1)  # what rank 0's recovery does (recover_elastic)
        assert model0.resync(1, 1.0) == STEPS  # its round, its rebuild from the replicas
        took = time.monotonic() - began
        restarted.join(60)
        assert not restarted.is_alive() and joined == [STEPS], joined
        assert took < window / 2, f"the recovery round waited {took:.1f} s for the new rank"
    finally:
        client0.close()
        ranks[1][0].close()


def test_a_rank_that_finds_nobody_to_rebuild_rebuilds_itself(servers) -> None:
    """Rank 0 trains two steps and dies, server 1 comes back empty, and rank 1 comes: nobody
    is left to rebuild server 1 (a node went down, then the other rank died during its
    recovery: field review, 1 run of 3). After ``join_window_s`` the new rank holds a
    recovery round itself, restores server 1 from server 0's replica and joins at step 2 with
    rank 0's parameters. Before, it waited ``timeout_s`` and raised "several versions"."""
    window = 2.0
    nodes = servers(2)
    addresses = [s.address for s in nodes]
    client0, model0, opt0 = rank(addresses, 0, window)
    try:
        train(model0, opt0)
        trained = {k: v.clone() for k, v in model0.state_dict().items()}
        replicated(client0)
    finally:
        vanish(client0)  # rank 0's process dies
    admin = ShardClient(ClusterSpec(addresses), timeout_s=30)
    try:
        admin.call(1, "DropJob", pb.DropJobRequest(job=JOB))  # server 1 restarted empty
    finally:
        admin.close()
    began = time.monotonic()
    client1, model1, _ = rank(addresses, 1, window)
    try:
        took = time.monotonic() - began
        assert model1.step_count == STEPS
        assert took < 30, f"it waited {took:.1f} s"  # timeout_s is 60
        got = model1.state_dict()
        assert all(torch.equal(got[k], v) for k, v in trained.items())
    finally:
        client1.close()


def test_a_server_lost_again_after_its_restore_starts_a_new_recovery(servers) -> None:
    """Server 1 comes back empty, rank 0's recovery round (epoch 1) restores it, and server 1
    is lost again right after (field review: a node down, then server 1 killed again during
    the recovery). The round of epoch 1 is done and restores nothing more: resync raises
    ABORTED so that the rank recovers again in a new epoch, where the job is restored again.
    Before, resync asked the done round again and again, for good (a rank stuck 190 s with
    no word in the review's run)."""
    with server_1_emptied(servers, window_s=1.0) as (_, client0, model0):
        restore = model0._recover_job

        def restore_then_lose() -> None:
            restore()
            client0.call(1, "DropJob", pb.DropJobRequest(job=JOB))  # and lost again

        model0._recover_job = restore_then_lose
        model0.restart_collectives(1)
        exc = resync_raises(model0, 1.0, "")
        assert exc.code == grpc.StatusCode.ABORTED and "lost again" in exc.details, exc
        model0._recover_job = restore
        model0.restart_collectives(2)
        assert model0.resync(2, 1.0) == STEPS  # epoch 2's round restores it again


@pytest.mark.parametrize("snapshots", [True, False], ids=["no-snapshot", "no-snapshot-dir"])
def test_a_job_that_no_server_replica_or_snapshot_holds_is_lost_at_once(
    servers, tmp_path, snapshots: bool
) -> None:
    """Both servers come back empty (a node down, then the other server killed during the
    recovery: field review), with no snapshot taken: the recovery round's leader finds no
    replica and no snapshot and raises ``JobLost``, which says so, instead of a NOT_FOUND
    that ``train_with_recovery`` recovers from again and again (the review's run had not
    ended after 300 s). Servers with a snapshot directory holding none, or with none."""
    nodes = servers(2, **({"snapshot_dir": str(tmp_path)} if snapshots else {}))
    addresses = [s.address for s in nodes]
    client0, model0, opt0 = rank(addresses, 0, window_s=1.0)
    try:
        train(model0, opt0)
        for i in range(2):
            client0.call(i, "DropJob", pb.DropJobRequest(job=JOB))  # both restarted empty
        model0.restart_collectives(1)
        why = "has no complete snapshot" if snapshots else "has no snapshot directory"
        with pytest.raises(JobLost, match=rf"cannot be recovered: no version .* {why}"):
            model0.resync(1, 1.0)
    finally:
        client0.close()


def test_looks_at_servers_that_disagree_after_the_round_are_paced_and_bounded(
    servers, monkeypatch
) -> None:
    """After its epoch's recovery round restored the job, a rank that still finds the servers
    at different versions looks again (the others train on and bring them to one step). Each
    look is paced (``SETTLE_S``) and they end after the client's ``timeout_s`` with
    DEADLINE_EXCEEDED, which starts a new recovery. Before, it looked without a pause and for
    good. The servers are real; what this rank sees of them after the restore is shifted
    (server 1 two steps ahead), as no real run keeps them apart on demand."""
    from paramshard.strategies.data_parallel import elastic_checkpoints as ec

    with server_1_emptied(servers, window_s=1.0) as (_, client0, model0):
        restored: list[bool] = []
        looks: list[list[int | None]] = []
        restore, look = model0._recover_job, ec.job_versions

        def restore_once() -> None:
            restore()
            restored.append(True)

        def seen(client: ShardClient, job: str) -> list[int | None]:
            versions = look(client, job)
            looks.append(versions)
            return [versions[0], versions[1] + 2] if restored else versions

        model0._recover_job = restore_once
        monkeypatch.setattr(ec, "job_versions", seen)
        client0.timeout_s = 2.0
        model0.restart_collectives(1)
        began = time.monotonic()
        exc = resync_raises(model0, 0.0, f" ({len(looks)} looks)")
        assert exc.code == grpc.StatusCode.DEADLINE_EXCEEDED, exc
        assert "still at versions [2, 4]" in exc.details, exc
        assert time.monotonic() - began >= 2.0
        after = len(looks) - 2  # the look that found server 1 empty, the one after the round
        assert restored == [True] and after <= 2.0 / ec.SETTLE_S + 2, len(looks)
