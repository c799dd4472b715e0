"""Losing a shard server loses no work: SIGKILL one server process mid-training, restart it at
the same address, and training ends with the parameters of an uninterrupted run.

Servers are real ``paramshard serve`` processes with a shared snapshot directory; the two
ranks are threads of this process running ``train_with_recovery`` (checkpoint every k steps,
restore the newest snapshot and replay after a failure). The model is float64: the recovered
run equals the uninterrupted one and single-process training within 1e-9 (tests/numerics.py).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from numerics import assert_equivalent
from server_processes import ServerProcess, killer

from paramshard.client import ClusterSpec, ShardClient
from paramshard.models.gpt import GPT, Block, GPTConfig, lm_loss
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.placement import replica_holder
from paramshard.strategies import (
    FSDPModel,
    FSDPOptimizer,
    HybridShardedModel,
    HybridShardedOptimizer,
    ShardingConfiguration,
    train_with_recovery,
)

STEPS, KILL_AT, EVERY, W = 30, 12, 5, 2
CFG = GPTConfig.tiny(vocab_size=50, bias=False)


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in GPT(CFG).double().state_dict().items()}


def new_gpt(init: dict[str, torch.Tensor]) -> GPT:
    net = GPT(CFG).double()
    net.load_state_dict(init)
    return net


def single_process(init, data, param_groups: bool) -> dict[str, torch.Tensor]:
    """AdamW (lr 3e-3, with the weight-decay groups or without), clipping at 1.0, the whole
    batch of every step: what both trainings below must end at."""
    net = new_gpt(init)
    opt = torch.optim.AdamW(net.param_groups(0.1) if param_groups else net.parameters(), lr=3e-3)
    for s in range(STEPS):
        lm_loss(net(data[s, :, :-1]), data[s, :, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return net.state_dict()


pytestmark = [pytest.mark.faults, pytest.mark.slow]


@pytest.fixture()
def cluster_of(tmp_path):
    """``cluster_of(n)``: n server processes sharing one snapshot directory."""
    started: list[ServerProcess] = []

    def start(n: int) -> list[ServerProcess]:
        servers = [ServerProcess(tmp_path / "snapshots") for _ in range(n)]
        started.extend(servers)
        for s in servers:
            s.start()
        return servers

    yield start
    for s in started:
        s.stop()


@pytest.fixture()
def cluster(cluster_of):
    return cluster_of(W)


def train(
    addresses,
    init,
    data,
    on_step=None,
    replicate_every=0,
    on_committed=None,
    at_end=None,
    should_stop=None,
):
    """W ranks of FSDP training with recovery; returns (final state dict, reports).
    ``on_committed(step, client, job)`` runs on rank 0 after the step's update, before the two
    all-reduces of the step's metrics (mean token accuracy, then the mean loss it returns).
    ``at_end(rank, client, job)``: each rank's ``finish`` runs it, then gathers the model
    there; the state returned is the last one gathered. ``should_stop(step, loss, rank,
    client, job)`` ends training early, as ``train_with_recovery``'s ``should_stop``."""
    job, run = f"recover-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:6]

    def rank(r: int):
        client = ShardClient(
            ClusterSpec(addresses), rank=r, world_size=W, run_id=run, timeout_s=15, retries=3
        )
        config = ShardingConfiguration(client, job=job, replicate_every=replicate_every)
        net = new_gpt(init)
        model = FSDPModel(net, config, wrap=(Block,))
        opt = FSDPOptimizer(torch.optim.AdamW(net.param_groups(0.1), lr=3e-3), config)

        def step(s: int) -> float:
            if on_step is not None and r == 0:
                on_step(s)
            part = data[s, r * 2 : (r + 1) * 2]
            logits = model(part[:, :-1])
            loss = lm_loss(logits, part[:, 1:])
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            if on_committed is None:
                return loss.item()
            if r == 0:
                on_committed(s, client, job)
            # small all-reduces rotate over the servers: one of the two meets server 1
            hits = (logits.argmax(-1) == part[:, 1:]).double().mean()
            client.all_reduce(hits.detach().reshape(1), "mean")  # a loop would log it
            return float(client.all_reduce(loss.detach().reshape(1), "mean")[0])

        gathered = []

        def finish() -> None:
            at_end(r, client, job)
            gathered.append(model.state_dict())

        def stop(s: int, loss: float) -> bool:
            return should_stop(s, loss, r, client, job)

        every = 0 if replicate_every else EVERY  # replicas alone, or snapshots alone
        try:
            report = train_with_recovery(
                model, step, STEPS, checkpoint_every=every, wait_s=60,
                finish=finish if at_end is not None else None,
                should_stop=stop if should_stop is not None else None,
            )  # fmt: skip
            return (gathered[-1] if at_end is not None else model.state_dict()), report
        finally:
            client.close()

    with ThreadPoolExecutor(W) as pool:
        return [f.result(timeout=600) for f in [pool.submit(rank, r) for r in range(W)]]


@pytest.mark.equivalence
@pytest.mark.parametrize("replicate_every", [0, 1, 4], ids=["snapshot", "replica-k1", "replica-k4"])
def test_server_killed_mid_training_recovers(cluster, replicate_every):
    init = initial_state()
    data = torch.randint(0, 50, (STEPS, 2 * W, 17), generator=torch.Generator().manual_seed(1))
    addresses = [s.address for s in cluster]

    reference = train(addresses, init, data)

    kill_server_1, killed, restarted_after = killer(cluster[1], KILL_AT)
    recovered = train(addresses, init, data, on_step=kill_server_1, replicate_every=replicate_every)
    assert killed.is_set() and restarted_after, "the server was not killed and restarted"
    for (state, report), (ref_state, _) in zip(recovered, reference, strict=True):
        assert report.recoveries == 1
        # a rank may fail finishing step KILL_AT-1 or at KILL_AT; either way at most
        # checkpoint_every steps are recomputed
        assert 0 <= report.replayed_steps <= (replicate_every or EVERY)
        assert_equivalent(state, ref_state, "recovered vs uninterrupted")
    assert_equivalent(reference[0][0], single_process(init, data, True), "uninterrupted")
    print(
        f"recovery ({f'replica k={replicate_every}' if replicate_every else 'snapshot'})"
        f" took {max(r.recovery_seconds[0] for _, r in recovered):.2f} s, replayed"
        f" {max(r.replayed_steps for _, r in recovered)} steps, causes"
        f" {[r.causes[0] for _, r in recovered]}"
        f" (server restart {restarted_after[0]:.2f} s)",
        file=sys.stderr,
    )
    assert os.listdir(cluster[0].snapshot_dir)


@pytest.mark.equivalence
def test_a_step_committed_before_the_failure_is_trained_not_replayed(cluster):
    """Server 1 dies after a step's update reached the servers (and their neighbour replicas)
    but before the step's metrics were all-reduced: every rank's step fails, the servers are
    one step ahead of it, and training goes on from there: the step counts as trained with
    no loss (``committed_without_loss``), nothing is replayed, the parameters are those of an
    uninterrupted run."""
    init = initial_state()
    data = torch.randint(0, 50, (STEPS, 2 * W, 17), generator=torch.Generator().manual_seed(3))
    addresses = [s.address for s in cluster]
    reference = train(addresses, init, data)

    kill_server_1, killed, restarted_after = killer(cluster[1], KILL_AT)

    def once_replicated(step: int, client: ShardClient, job: str) -> None:
        """Kills server 1 once its neighbour holds the step's update (replicas go after it)."""
        if step == KILL_AT and not killed.is_set():
            wait_for_replica(client, job, 1, KILL_AT + 1)
        kill_server_1(step)

    recovered = train(addresses, init, data, replicate_every=1, on_committed=once_replicated)
    assert killed.is_set() and restarted_after, "the server was not killed and restarted"
    for (state, report), (ref_state, _) in zip(recovered, reference, strict=True):
        assert report.recoveries == 1 and report.failed_at == [KILL_AT], report
        assert report.resumed_at == [KILL_AT + 1] and report.replayed_steps == 0, report
        assert report.committed_without_loss == [KILL_AT]
        assert KILL_AT not in report.losses and report.trained_steps == list(range(STEPS))
        assert_equivalent(state, ref_state, "recovered vs uninterrupted")


def wait_for_replica(client: ShardClient, job: str, source: int, version: int) -> None:
    """Waits (at most 30 s) until server ``source``'s neighbour holds its copy at ``version``."""
    holder = replica_holder(source, client.num_servers)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        held = client.call(holder, "ListReplicas", pb.ListReplicasRequest(job=job)).replicas
        if any(not r.own and r.source_index == source and r.version >= version for r in held):
            return
        time.sleep(0.01)
    raise AssertionError(f"server {source}'s replica at version {version} never arrived")


def train_3d(addresses, init, data, on_step=None, job=None):
    """(pp, tp, dp) = (2, 2, 1) over 4 servers, each part on its own rank's server, with
    recovery from snapshots every EVERY steps; returns (final state dict, report) per rank."""
    job, run = job or f"recover3d-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:6]

    def rank(r: int):
        client = ShardClient(
            ClusterSpec(addresses), rank=r, world_size=4, run_id=run, timeout_s=15, retries=3
        )
        config = ShardingConfiguration(client, job=job)
        net = new_gpt(init)
        model = HybridShardedModel(net, config, 2, 2, 1, micro_batch_count=2)
        HybridShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), config)

        def step(s: int) -> float:
            if on_step is not None and r == 0:
                on_step(s)
            return model.train_on_batch(data[s, :, :-1], data[s, :, 1:], max_grad_norm=1.0)

        report = train_with_recovery(model, step, STEPS, checkpoint_every=EVERY, wait_s=60)
        return model.state_dict(), report

    with ThreadPoolExecutor(4) as pool:
        return [f.result(timeout=600) for f in [pool.submit(rank, r) for r in range(4)]]


@pytest.mark.equivalence
def test_3d_job_recovers_from_a_killed_server(cluster_of):
    """Server 1 holds part pp0.tp1 alone (dp = 1) and the mailboxes and tensor-parallel
    sums of rank 1: killed mid-training and restarted, it gets its part back from the newest
    snapshot, every group's collectives restart, and training ends where it would have."""
    init = initial_state()
    data = torch.randint(0, 50, (STEPS, 4, 17), generator=torch.Generator().manual_seed(2))
    cluster = cluster_of(4)
    addresses = [s.address for s in cluster]
    reference = train_3d(addresses, init, data)

    kill_server_1, killed, restarted_after = killer(cluster[1], KILL_AT)
    job = f"recover3d-{uuid.uuid4().hex[:6]}"
    recovered = train_3d(addresses, init, data, on_step=kill_server_1, job=job)
    assert killed.is_set() and restarted_after, "the server was not killed and restarted"
    # after the recovery, checkpoint tags carry the epoch: a tag some parts committed before
    # the failure is never written again
    from paramshard.client import tools

    c = ShardClient(ClusterSpec(addresses))
    try:
        tags = {r["tag"] for r in tools.list_snapshots(c, job, combine_parts=True)}
    finally:
        c.close()
    assert {"auto-10", "auto-15-e1", "auto-30-e1"} <= tags, tags
    for (state, report), (ref_state, _) in zip(recovered, reference, strict=True):
        assert report.recoveries == 1
        assert 0 <= report.replayed_steps <= EVERY
        # a rank waiting for another rank's tensor learned of the failure from the abort
        # notice (ABORTED), not at its 15 s deadline (client/leases.py)
        assert report.causes[0] != "DEADLINE_EXCEEDED", report.causes
        assert list(state) == list(ref_state)
        assert_equivalent(state, ref_state, "recovered vs uninterrupted")
    assert_equivalent(reference[0][0], single_process(init, data, False), "uninterrupted")
    print(
        f"3D recovery took {max(r.recovery_seconds[0] for _, r in recovered):.2f} s, replayed"
        f" {max(r.replayed_steps for _, r in recovered)} steps, causes"
        f" {[r.causes[0] for _, r in recovered]}"
        f" (server restart {restarted_after[0]:.2f} s)",
        file=sys.stderr,
    )


def test_3d_job_refuses_neighbour_replication():
    client = ShardClient(ClusterSpec(["127.0.0.1:1"]), rank=0, world_size=2)
    config = ShardingConfiguration(client, job="x", replicate_every=1)
    try:
        with pytest.raises(ValueError, match="replicate_every=1.*checkpoint_every"):
            HybridShardedModel(GPT(CFG), config, 2, 1, 1)
    finally:
        client.close()


def test_fresh_server_restores_latest_snapshot_at_start(tmp_path):
    """``serve --snapshot-dir D --restore latest --index I`` comes back with its part."""
    from paramshard.client import tools
    from paramshard.server import ShardServer

    snaps = tmp_path / "snaps"
    first = [ShardServer(snapshot_dir=str(snaps)).start() for _ in range(2)]
    try:
        c = ShardClient(ClusterSpec([s.address for s in first]))
        c.register_buffer("j", "b", 11, optimizer="sgd", hyper={"lr": 0.1})
        c.set_params("j", "b", torch.arange(11, dtype=torch.float32).numpy(), version=3)
        tools.snapshot(c, "j", "old")
        c.set_params("j", "b", torch.full((11,), 7.0).numpy(), version=4)
        tools.snapshot(c, "j", "new")
        c.close()
    finally:
        for s in first:
            s.stop()
    fresh = ServerProcess(snaps)
    try:
        lines = fresh.start("--restore", "latest", "--index", "1")
        assert any("restored j/new at version 4" in x for x in lines), lines
        c = ShardClient(ClusterSpec([fresh.address]))
        try:
            (row,) = c.status()
        finally:
            c.close()
        (buf,) = row["jobs"][0]["buffers"]
        assert int(buf["version"]) == 4 and int(buf["slice_start"]) == 6  # slice 1 of 11 over 2
    finally:
        fresh.stop()
