"""Elastic ZeRO-2 and FSDP: ranks leave, die and join at chosen steps, and the result is single-
process training on the same global batches (float64, within 1e-9, tests/numerics.py), the
same bits in two runs of the same membership schedule.

Ranks are threads of this process on in-process servers, each with its own client, training
through ``train_with_recovery`` with ``model.batch_part`` (and ``micro_batch_parts`` for
gradient accumulation), clipping and an LR schedule. A rank *dies* by closing its channels
without a word (its lease lapses, as a killed process's does: tests/test_elastic_launch.py kills
real processes); a rank *leaves* by raising, as a ``LocalCluster`` rank would, and saying
goodbye. A rank *joins* at step s: it starts while step s-1 trains, and the members of s-1 wait
for the coordinator to list it as waiting, so it joins exactly at s in every run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
import torch
from numerics import assert_equivalent

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.membership import MembershipError
from paramshard.strategies import (
    FSDPModel,
    FSDPOptimizer,
    ShardedGradScaler,
    ShardingConfiguration,
    ZeRO2Model,
    ZeRO2Optimizer,
    train_with_recovery,
)

pytestmark = [
    pytest.mark.faults,
    pytest.mark.timeout(600),
    pytest.mark.usefixtures("one_torch_thread"),
]

STEPS, BATCH, WORLD, LR = 10, 12, 4, 1e-2


def _initial() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    model = net(None)
    return {
        k: torch.randn(v.shape, generator=gen, dtype=v.dtype) * 0.3
        for k, v in model.state_dict().items()
    }


def net(init: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """The model, holding ``init`` (the same values on every rank: threads share torch's
    global RNG, so no rank seeds it)."""
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(), torch.nn.Linear(32, 3)
    ).double()
    if init is not None:
        model.load_state_dict(init)
    return model


INIT = _initial()


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(STEPS, BATCH, 8, generator=g, dtype=torch.float64)
    return x, torch.randn(STEPS, BATCH, 3, generator=g, dtype=torch.float64)


def schedule(step: int) -> float:
    return 1.0 / (1 + step)  # LambdaLR's factor: a decay by the global step


def single_process(
    x: torch.Tensor, y: torch.Tensor, skipped: tuple[int, ...] = (), steps: int = STEPS
) -> dict[str, torch.Tensor]:
    """AdamW with the LR schedule, clipping at 1.0, the whole global batch of each of the
    first ``steps`` steps; the ``skipped`` steps update nothing (their schedule still moves
    on)."""
    model = net(INIT)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for s in range(steps):
        torch.nn.functional.mse_loss(model(x[s]), y[s]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if s not in skipped:
            opt.step()
        opt.zero_grad()
        sched.step()
    return model.state_dict()


@dataclass
class Job:
    """One elastic training: its servers' addresses, events by rank, and what ranks did."""

    addresses: list[str]
    strategy: str
    starts: dict[int, int]  # rank -> the step it joins at (0: from the start)
    dies: dict[int, int] = field(default_factory=dict)  # rank -> step it dies at (no goodbye)
    leaves: dict[int, int] = field(default_factory=dict)  # rank -> step it raises at
    accumulation: int = 1
    scaler: bool = False  # ShardedGradScaler: scales that grow every 3 steps
    run: str = "elastic"
    results: dict[int, tuple[dict, object]] = field(default_factory=dict)
    scales: dict[int, list[float]] = field(default_factory=dict)  # each rank's, after each step
    threads: dict[int, threading.Thread] = field(default_factory=dict)
    coordinator: ShardClient | None = None

    def wait_listed(self, rank: int, step: int) -> None:
        """Until the coordinator lists ``rank`` waiting to join ``step`` (at most 120 s)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            (row,) = [m for m in self.coordinator.status()[0]["memberships"] if m["job"] == "j"]
            if rank in row.get("waiting", []):
                return
            time.sleep(0.05)
        raise AssertionError(f"rank {rank} never waited to join step {step}")


def vanish(client: ShardClient) -> None:
    """What a process's death does to its client, for a rank that is a thread: its lease
    streams end without a release and nothing renews or reopens them (the kernel closes a dead
    process's connections), and its channels close."""
    holding = client.run_state.holding
    holding.released = True  # the process's renewing thread drops it; no release is sent
    holding.close_holds()
    client.spec.close()


def rank_body(job: Job, r: int, x: torch.Tensor, y: torch.Tensor) -> None:
    client = ShardClient(
        ClusterSpec(job.addresses), rank=r, world_size=WORLD, run_id=job.run, timeout_s=60
    )
    config = ShardingConfiguration(
        client,
        job="j",
        elastic=True,
        min_world_size=2,
        join_window_s=20.0,
        gradient_accumulation_steps=job.accumulation,
    )
    if job.strategy == "fsdp":
        model = FSDPModel(net(INIT), config, wrap=(torch.nn.Linear,))
        opt = FSDPOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), config)
    else:
        model = ZeRO2Model(net(INIT), config)
        opt = ZeRO2Optimizer(torch.optim.AdamW(model.parameters(), lr=LR), config)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    scaler = ShardedGradScaler(init_scale=2.0**10, growth_interval=3, enabled=job.scaler)

    def train_step(s: int) -> float:
        for later, at in job.starts.items():  # the others let a joining rank in at its step
            if at == s + 1 and r == min(model.step_members):
                job.threads[later].start()
                job.wait_listed(later, at)
        if job.leaves.get(r) == s:
            raise RuntimeError(f"rank {r} gives up at step {s}")
        if job.dies.get(r) == s:  # a member of step s, gone before any of its gradients
            vanish(client)  # the process vanishes: no goodbye, its lease lapses
            raise SystemExit
        loss = 0.0
        for part in model.micro_batch_parts(BATCH):
            out = torch.nn.functional.mse_loss(model(x[s, part]), y[s, part])
            scaler.scale(out).backward()
            loss += out.item()
        scaler.unscale_(opt)
        model.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        job.scales.setdefault(r, []).append(scaler.get_scale())
        return loss

    try:
        report = train_with_recovery(model, train_step, STEPS, checkpoint_every=0, scheduler=sched)
        job.results[r] = (model.state_dict(), report)
    except RuntimeError:
        model.leave("it raised")
    except SystemExit:
        return
    finally:
        client.close()


def run(job: Job, x: torch.Tensor, y: torch.Tensor) -> Job:
    job.coordinator = ShardClient(ClusterSpec(job.addresses[:1]))
    for r in job.starts:
        job.threads[r] = threading.Thread(target=rank_body, args=(job, r, x, y), name=f"r{r}")
    for r, at in job.starts.items():
        if at == 0:
            job.threads[r].start()
    for t in job.threads.values():
        deadline = time.monotonic() + 400
        while not t.is_alive() and not t.ident and time.monotonic() < deadline:
            time.sleep(0.05)  # a joining rank's thread is started by the others
        t.join(max(0.0, deadline - time.monotonic()))
        assert not t.is_alive(), f"{t.name} still running"
    job.coordinator.close()
    return job


def history(job_servers: list[str]) -> list[tuple[int, str, int]]:
    c = ShardClient(ClusterSpec(job_servers[:1]))
    try:
        (row,) = c.status()[0]["memberships"]
    finally:
        c.close()
    return [(int(e["step"]), e["kind"], e["rank"]) for e in row["history"]]


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_ranks_die_leave_and_join_and_training_equals_one_process(servers, strategy) -> None:
    x, y = data()
    want = single_process(x, y)
    finals = []
    for attempt in range(2):  # the same membership schedule twice: the same bits
        addresses = [s.address for s in servers(2)]
        job = run(
            Job(
                addresses,
                strategy,
                starts={0: 0, 1: 0, 2: 0, 3: 4},
                dies={2: 2},
                leaves={1: 6},
                run=f"e{attempt}",
            ),
            x,
            y,
        )
        assert sorted(job.results) == [0, 3], "ranks 0 and 3 train to the end"
        for r, (state, _) in job.results.items():
            assert_equivalent(state, want, f"{strategy} run {attempt} rank {r} vs one process")
        assert job.results[0][1].recoveries == 2  # rank 2 lost, rank 1 gone
        assert history(addresses) == [
            (0, "join", 0), (0, "join", 1), (0, "join", 2),
            (2, "lost", 2), (4, "join", 3), (6, "leave", 1),
        ]  # fmt: skip
        finals.append(job.results[0][0])
    for name in finals[0]:
        assert torch.equal(finals[0][name], finals[1][name]), name


@pytest.mark.equivalence
def test_gradient_accumulation_with_a_joining_rank(servers) -> None:
    x, y = data(2)
    want = single_process(x, y)
    addresses = [s.address for s in servers(2)]
    job = run(Job(addresses, "fsdp", starts={0: 0, 1: 0, 2: 3}, accumulation=2), x, y)
    assert sorted(job.results) == [0, 1, 2]
    for r, (state, _) in job.results.items():
        assert_equivalent(state, want, f"accumulation, rank {r} vs one process")


def test_below_the_minimum_a_rank_waits_then_names_who_is_there(servers) -> None:
    addresses = [s.address for s in servers(1)]
    client = ShardClient(ClusterSpec(addresses), rank=1, world_size=3, run_id="few", timeout_s=10)
    config = ShardingConfiguration(
        client, job="few", elastic=True, min_world_size=2, join_window_s=0.5, elastic_wait_s=1.0
    )
    model = FSDPModel(net(INIT), config)
    began = time.monotonic()
    try:
        FSDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)  # joins no step
        with pytest.raises(MembershipError, match=r"1 rank\(s\) there \(ranks 1\), fewer than"):
            model.batch_part(4)  # the first step's join waits for a second rank
    finally:
        client.close()
    assert time.monotonic() - began < 30


def test_ddp_and_3d_refuse_to_be_elastic() -> None:
    """Their ranks keep state in the process: no rank may leave or join, they say so."""
    from paramshard.strategies import DDPModel, HybridShardedModel

    client = ShardClient(ClusterSpec(["127.0.0.1:1"]), rank=0, world_size=2)  # never called
    try:
        config = ShardingConfiguration(client, job="d", elastic=True)
        with pytest.raises(ValueError, match=r"elastic=True\) needs ZeRO-1, ZeRO-2 or FSDP: a ddp"):
            DDPModel(net(INIT), config)
        with pytest.raises(ValueError, match=r"needs ZeRO-1, ZeRO-2 or FSDP: a hybrid rank"):
            HybridShardedModel(net(INIT), config, 2, 1, 1)
    finally:
        client.close()


def test_finish_is_refused_for_an_elastic_job_before_any_step(servers) -> None:
    """``train_with_recovery(finish=)`` holds every rank in a barrier at the end, which an
    elastic job's members cannot promise: refused by name, nothing trained."""
    client = ShardClient(ClusterSpec([servers(1)[0].address]), rank=0, world_size=1, run_id="f")
    try:
        config = ShardingConfiguration(client, job="fin", elastic=True, join_window_s=0.5)
        model = FSDPModel(net(INIT), config)
        FSDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
        steps: list[int] = []
        with pytest.raises(ValueError, match=r"finish= is not supported for an elastic job"):
            train_with_recovery(model, steps.append, 3, finish=lambda: None)
        assert steps == [] and model.step_count == 0
    finally:
        client.close()


def local_rank(config: ShardingConfiguration) -> dict[str, torch.Tensor]:
    """A ``LocalCluster`` rank: rank 1 raises in step 3 (it leaves: the others redo it)."""
    x, y = data(3)
    model = FSDPModel(net(INIT), config, wrap=(torch.nn.Linear,))
    opt = FSDPOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), config)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)

    def train_step(s: int) -> float:
        part = model.batch_part(BATCH)
        if config.rank == 1 and s == 3:
            raise ValueError("rank 1's data loader broke")
        loss = torch.nn.functional.mse_loss(model(x[s, part]), y[s, part])
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    train_with_recovery(model, train_step, STEPS, checkpoint_every=0, scheduler=sched)
    return model.state_dict()


@pytest.mark.equivalence
@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_local_cluster_rank_that_raises_leaves_and_the_others_train_on(processes: bool) -> None:
    """Ranks as threads, or as spawned processes: rank 1's process returns its error and
    exits, and its lease ends with it."""
    from paramshard import LocalCluster, RankLeft

    x, y = data(3)
    want = single_process(x, y)
    with LocalCluster(
        3,
        servers=2,
        processes=processes,
        run_timeout_s=240,
        elastic=True,
        min_world_size=2,
        timeout_s=60,
    ) as cluster:
        results = cluster.run(local_rank)
    left = results[1]
    assert isinstance(left, RankLeft) and left.rank == 1
    assert "data loader broke" in str(left.error)
    for r in (0, 2):
        assert_equivalent(results[r], want, f"LocalCluster rank {r} vs one process")


def test_elastic_settings_from_the_environment_and_config_files(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PARAMSHARD_SERVERS", "127.0.0.1:1")  # never called
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("PARAMSHARD_ELASTIC", "1")
    config = ShardingConfiguration.from_env(job="e")
    assert config.elastic and config.min_world_size == 1
    config.client.close()
    path = tmp_path / "sharding.toml"
    path.write_text("elastic = false\njoin_window_s = 2.5\n")
    monkeypatch.setenv("PARAMSHARD_CONFIG", str(path))
    config = ShardingConfiguration.from_env(job="e")  # the launcher's variable wins the file
    assert config.elastic and config.join_window_s == 2.5
    config.client.close()
    monkeypatch.setenv("PARAMSHARD_ELASTIC", "yes")
    with pytest.raises(ValueError, match="PARAMSHARD_ELASTIC must be 0 or 1, got 'yes'"):
        ShardingConfiguration.from_env(job="e")
    monkeypatch.setenv("PARAMSHARD_ELASTIC", "1")
    monkeypatch.setenv("PARAMSHARD_MIN_NPROC", "2")
    with pytest.raises(ValueError, match="min_world_size 2 is more than the world size 1"):
        ShardingConfiguration.from_env(job="e")
    path.write_text("join_window_s = 0\n")
    monkeypatch.delenv("PARAMSHARD_MIN_NPROC")
    with pytest.raises(ValueError, match="join_window_s must be a positive finite number"):
        ShardingConfiguration.from_env(job="e")


@pytest.mark.equivalence
def test_loss_scaling_a_joining_rank_costs_one_skipped_step(servers) -> None:
    """Rank 2 joins at step 4 with a fresh scaler (2**10) while the others grew to 2**11:
    step 4 is skipped everywhere, as for an overflow, every rank takes the others' state and
    backs off, and the scales agree from then on."""
    x, y = data(5)
    want = single_process(x, y, skipped=(4,))
    addresses = [s.address for s in servers(2)]
    job = run(Job(addresses, "fsdp", starts={0: 0, 1: 0, 2: 4}, scaler=True), x, y)
    assert sorted(job.results) == [0, 1, 2]
    for r, (state, _) in job.results.items():
        assert_equivalent(state, want, f"loss scaling, rank {r} vs one process")
    assert job.scales[0][3] == 2.0**11 and job.scales[2][0] == 2.0**10  # after the skip
    assert job.scales[0][4:] == job.scales[1][4:] == job.scales[2]
    assert job.results[0][1].losses.keys() == set(range(STEPS))
