"""The ranks of benchmarks/hybrid.py: ours (HybridShardedModel over shard servers) and torch's
twin (torch.distributed.pipelining stages, DTensor tensor parallelism, both over a device mesh),
each timing its steps."""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks._cpu import cpu_self_s
from benchmarks._processes import child_guard, emit
from benchmarks._training import (
    adamw,
    build_gpt,
    close_rank,
    end_gloo,
    hosted_server,
    init_gloo,
    make_batches,
    parse_list,
    set_threads,
    wait_exit,
)


def ours_main(a: argparse.Namespace) -> None:
    """One rank of ours: hosts a server, then trains one HybridShardedModel per value of
    ``--micro-batches`` (a fresh model, client run and job each), ``--steps`` steps each."""
    t_start = time.monotonic()
    child_guard(a.lifetime)
    from paramshard.client import ClusterSpec, ShardClient

    set_threads(a.world)
    server, clients = None, []
    try:
        server, addresses = hosted_server()
        batches = make_batches(a.model, a.world, a.steps)
        runs, t_first = [], None
        for m in parse_list(a.micro_batches, int):
            tag = f"{a.run}-m{m}"
            client = ShardClient(
                ClusterSpec(addresses), rank=a.rank, world_size=a.world, run_id=tag, timeout_s=120.0
            )
            clients.append(client)
            run, t_train = _ours_run(a, client, m, f"bench-{a.cell}-{tag}", batches)
            runs.append(run)
            t_first = t_first or t_train
        t_first = t_first or time.monotonic()
        phases = {
            "setup": round(t_first - t_start, 2),  # the first model's; later ones count as train
            "train": round(time.monotonic() - t_first, 2),
        }
        emit("RESULT", {"rank": a.rank, "runs": runs, "phases_s": phases})
        wait_exit()
    finally:
        close_rank(clients, server)  # a failed rank's too: see close_rank


def _ours_run(
    a: argparse.Namespace, client: Any, m: int, job: str, batches: list[Any]
) -> tuple[dict[str, Any], float]:
    """One HybridShardedModel with ``m`` micro-batches trained on ``batches``: its timings
    and losses, and when its training began."""
    from benchmarks._llama_stages import llama_split_points
    from paramshard.models.gpt import lm_loss
    from paramshard.strategies import (
        HybridShardedModel,
        HybridShardedOptimizer,
        ShardingConfiguration,
    )

    llama = a.family == "llama"
    config = ShardingConfiguration(client, job=job, timeout_s=120.0)
    net = build_model(a.family, a.model)
    model = HybridShardedModel(
        net,
        config,
        pipeline_parallel_size=a.pp,
        tensor_parallel_size=a.tp,
        data_parallel_size=a.dp,
        micro_batch_count=m,
        schedule=a.schedule,
        split_points=llama_split_points(net, a.pp) if llama and a.pp > 1 else None,
    )
    if llama:  # HF returns a ModelOutput; the same loss as torch's side
        model.default_loss_function = lambda out, y: lm_loss(out.logits, y)
    HybridShardedOptimizer(adamw(model.parameters()), config)
    per = batches[0][0].shape[0] // model.data_parallel_size
    lo = model.data_parallel_rank * per
    pipe = model.pipeline
    run: dict[str, Any] = {"micro_batches": m, "coords": list(model.coords)}
    run.update(times_s=[], optimizer_s=[], losses=[], bubble=[], timing=[])
    t_train, cpu0 = time.monotonic(), cpu_self_s()
    for x, y in batches:
        s0 = time.perf_counter()
        part = x[lo : lo + per]
        # train_on_batch's two parts, timed apart: the optimizer step is this rank's part's
        # push, its servers' step and the pull (torch's side: the dp average and AdamW)
        loss = model.forward_backward({"input_ids": part} if llama else part, y[lo : lo + per])
        s1 = time.perf_counter()
        model.optimizer.step()
        model.optimizer.zero_grad()
        run["optimizer_s"].append(time.perf_counter() - s1)
        run["times_s"].append(time.perf_counter() - s0)
        run["losses"].append(loss)
        run["bubble"].append(pipe.last_bubble_fraction)
        run["timing"].append(dict(pipe.last_timing))
    run["cpu_s"] = cpu_self_s() - cpu0
    run["theoretical_fraction"] = pipe.theoretical_bubble_fraction
    run["paper_ratio"] = pipe.paper_bubble_ratio
    return run, t_train


def torch_main(a: argparse.Namespace) -> None:
    """One gloo rank (or the single process) of a torch cell."""
    t_start = time.monotonic()
    child_guard(a.lifetime)
    from benchmarks._torch_parallel import build_cell, build_llama_cell

    single = a.cell == "single"
    set_threads(1 if single else a.world)
    if not single:
        init_gloo(a.port, a.rank, a.world)
    batches = make_batches(a.model, a.world, a.steps)
    build = build_llama_cell if a.family == "llama" else build_cell
    step, rows = build(
        a.cell,
        build_model(a.family, a.model),
        a.rank,
        a.world,
        (a.pp, a.tp, a.dp),
        int(a.micro_batches),
        a.schedule,
        batches[0][0].shape[0],
    )
    times, optimizer, losses = [], [], []
    t_setup, cpu0 = time.monotonic(), cpu_self_s()
    for x, y in batches:
        s0 = time.perf_counter()
        losses.append(step(x[rows], y[rows]))
        times.append(time.perf_counter() - s0)
        optimizer.append(step.optimizer_s)
    t_train = time.monotonic()
    phases = {"setup": round(t_setup - t_start, 2), "train": round(t_train - t_setup, 2)}
    run = {"micro_batches": int(a.micro_batches), "times_s": times, "losses": losses}
    run["optimizer_s"] = optimizer
    run["cpu_s"] = cpu_self_s() - cpu0
    emit("RESULT", {"rank": a.rank, "runs": [run], "phases_s": phases})
    if not single:
        end_gloo()


def build_model(family: str, model: str) -> Any:
    """The example GPT or the HF Llama (``benchmarks._llama_stages``) of size ``model``,
    seeded: the same on every rank and on both sides."""
    if family == "llama":
        from benchmarks._llama_stages import build_llama

        return build_llama(model)
    return build_gpt(model)
