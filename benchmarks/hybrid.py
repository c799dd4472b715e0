"""Step time of our pipeline, tensor and 3D parallelism against PyTorch's own, on the same
model: the example GPT and Hugging Face's Llama.

    python -m benchmarks.hybrid [--quick] [--models tiny] [--world-sizes 4,2] [--steps N]
                                [--warmup K] [--micro-batches M] [--wait-quiet S]
                                [--family gpt|llama|both]

For every model size and world size W, in one run (torch and ours interleaved, cell by cell,
so both sides see the same machine load):

- **ours**: ``HybridShardedModel`` with W trainer processes, each hosting its own in-process
  ``ShardServer`` (as ``benchmarks.strategies`` does by default), started with ``subprocess``
  and ``server.MALLOC_ENV``. Cells (pipeline x tensor x data):
  ``pp_gpipe`` = (W, 1, 1) GPipe, ``pp_1f1b`` = (W, 1, 1) 1F1B, ``tp`` = (1, W, 1) and
  ``3d`` = (2, 2, W/4) GPipe (as the anchor's mode "3d"; only where 4 divides W). A step is
  ``model.train_on_batch(x, y)``: forward and backward through the schedule, then the
  optimizer step (ZeRO-1 on the servers of each (stage, tensor rank)).
- **torch** (gloo, same GPT, same batches, same AdamW; ``benchmarks/_torch_parallel.py``):
  ``torch.distributed.pipelining`` ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``
  over the same stages (``benchmarks/_gpt_stages.py``); DTensor ``parallelize_module`` with
  Megatron's split of attention (by heads: our packed q|k|v ``c_attn`` is first rewritten as
  three Linears with the same weights, since a plain ``ColwiseParallel`` on it would not split
  by heads) and of the MLP; 3D = device mesh (pp, tp, dp) + pipelining GPipe + DTensor TP +
  an all-reduce of the gradients over dp. Plus single-process training on the whole global
  batch (the numerical reference).

Model: ``examples.gpt`` with the anchors' sizes (see ``benchmarks/_training.py``): tiny =
``GPTConfig.tiny(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128,
tie_weights=False)``, 867,072 parameters. The global batch is W x 8 sequences (as the anchors'
``W*B``): the pipeline cells run all of it through the pipeline in m micro-batches, the tensor
cell gives all of it to every rank, the 3D cell splits it over the dp replicas. m defaults to
2 x the number of stages for the pipeline cells (``--micro-batches`` sets it), 1 for ``tp``;
both sides use the same m.

Llama (``--family``, default both; ``benchmarks/_llama_stages.py``): ``LlamaForCausalLM`` from
a config (tiny: hidden 256, 4 layers, 4 heads, 2 key/value heads, 3,033,344 parameters, SDPA)
on the same batches. Ours is given ``split_points=["model.layers.2"]`` and no plan (Llama's
own), ``train_on_batch({"input_ids": x}, y)``; torch's side pipelines stage modules with the
same cut and applies Llama's plan as DTensor styles. Its cells always have 2 stages and 2
tensor ranks, the other ranks data-parallel: pp = (2, 1, W/2), tp = (1, 2, W/2), 3d = (2, 2,
W/4). Each row also gives step 1's loss on both sides (``first_step_loss``).

A cell's step time is the slowest rank's; we report the median over the steps after
``--warmup``, and ratio = ours / torch. Losses: the largest relative difference, over the
steps, from single-process training on the same batches.

Bubble (ours): each stage times its compute (forward and backward of its layers) within the
schedule's wall time (``PipelineParallelModel.last_timing``); measured fraction = 1 - compute
/ wall (``last_bubble_fraction``, compared with (p-1)/(m+p-1)) and idle / compute (compared
with the papers' (p-1)/m), medians over the timed steps. The "bubble sweep" runs ours alone at
p = 2 and 4 stages (W = p, global batch p x 8) with 1F1B and m in {1, 2, 4, 8}. Idle time
includes the transfers through the servers; on a 2-core machine stages also wait for a core.

JSON goes to stdout; progress to stderr. Every child process is started here, dies with this
process and is stopped by PID (``benchmarks/_processes.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import time
import uuid
from typing import Any

from benchmarks._processes import (
    Load,
    child_guard,
    cpu_self_s,
    emit,
    free_port,
    install_cleanup,
    logger,
)
from benchmarks._training import (
    MODELS,
    STARTUP_S,
    adamw,
    attempt_cell,
    build_gpt,
    end_gloo,
    hosted_server,
    init_gloo,
    launch_ranks,
    make_batches,
    max_rel_diff,
    mean_losses,
    measured,
    median_ms,
    model_info,
    models_and_worlds,
    parse_list,
    print_report,
    run_main,
    set_threads,
    steps_and_warmup,
    wait_exit_then_close,
)

CELLS = ("pp_gpipe", "pp_1f1b", "tp", "3d")
SCHEDULE = {"pp_gpipe": "gpipe", "pp_1f1b": "1f1b", "tp": "1f1b", "3d": "gpipe"}
FAMILIES = {"gpt": ("gpt",), "llama": ("llama",), "both": ("gpt", "llama")}
SLOWER = {"gpt": 1, "llama": 4}  # step budget: Llama tiny has 3.5x the GPT's parameters
TORCH_LABEL = {
    "gpt": {
        "single": "single process, whole global batch",
        "pp_gpipe": "pipelining PipelineStage + ScheduleGPipe (gloo)",
        "pp_1f1b": "pipelining PipelineStage + Schedule1F1B (gloo)",
        "tp": "DTensor parallelize_module: q,k,v + MLP c_fc Colwise, c_proj Rowwise (gloo)",
        "3d": "mesh (pp,tp,dp): pipelining ScheduleGPipe + DTensor TP + dp grad all-reduce",
    },
    "llama": {
        "single": "single process, whole global batch, LlamaForCausalLM's forward",
        "pp_gpipe": "pipelining PipelineStage + ScheduleGPipe, _llama_stages (gloo)",
        "pp_1f1b": "pipelining PipelineStage + Schedule1F1B, _llama_stages (gloo)",
        "tp": "DTensor parallelize_module, Llama's plan: q,k,v,gate,up Colwise, o,down"
        " Rowwise, lm_head Colwise gathered (gloo)",
        "3d": "mesh (pp,tp,dp): pipelining ScheduleGPipe + DTensor TP (Llama's plan)",
    },
}
SWEEP_STAGES, SWEEP_MICRO = (2, 4), (1, 2, 4, 8)
NOTES = {
    "ratio": "ours_ms / torch_ms (lower is better); medians of the slowest rank's step time",
    "cpu": "*_cpu_ms_per_step: CPU ms per step summed over the ranks (ours: servers included,"
    " they run in the ranks' processes), all steps",
    "torch_tp": "attention and MLP both sharded (Megatron): our packed c_attn is rewritten on"
    " the torch side as three Linears q, k, v with the same weights, each ColwiseParallel,"
    " so both sides split attention by heads; a plain ColwiseParallel on the packed c_attn"
    " would not (rank 0 would get all of q and part of k)",
    "llama": "HF LlamaForCausalLM (benchmarks/_llama_stages.py), the same batches as the"
    " GPT: 2 pipeline stages (ours: split_points model.layers.L/2; torch: stage modules with"
    " the same cut), 2 tensor ranks (Llama's own plan on both sides), the other ranks"
    " data-parallel: pp = (2, 1, W/2), tp = (1, 2, W/2), 3d = (2, 2, W/4)",
    "first_step_loss": "step 1's loss, mean over the ranks that report it, per side",
    "micro_batches": "pipeline cells: m = 2 x stages unless --micro-batches; the same m on"
    " both sides; tp: 1",
    "bubble": "ours only; per rank: measured_fraction = 1 - compute / wall of the schedule"
    " (vs theoretical_fraction (p-1)/(m+p-1)), measured_idle_over_compute = (wall - compute)"
    " / compute (vs paper_ratio (p-1)/m); medians over the timed steps. Idle includes the"
    " transfers through the servers and, on this 2-core machine, waiting for a core",
}

log = logger("hybrid")


# ================================================================================ the ranks
def ours_main(a: argparse.Namespace) -> None:
    """One rank of ours: hosts a server, then trains one HybridShardedModel per value of
    ``--micro-batches`` (a fresh model, client run and job each), ``--steps`` steps each."""
    t_start = time.monotonic()
    child_guard(a.lifetime)
    from benchmarks._llama_stages import llama_split_points
    from client import ClusterSpec, ShardClient
    from examples.gpt import lm_loss
    from strategies import HybridShardedModel, HybridShardedOptimizer, ShardingConfiguration

    llama = a.family == "llama"
    set_threads(a.world)
    server, addresses = hosted_server()
    batches = make_batches(a.model, a.world, a.steps)
    clients, runs = [], []
    t_first = None
    for m in parse_list(a.micro_batches, int):
        tag = f"{a.run}-m{m}"
        client = ShardClient(
            ClusterSpec(addresses), rank=a.rank, world_size=a.world, run_id=tag, timeout_s=120.0
        )
        clients.append(client)
        config = ShardingConfiguration(client, job=f"bench-{a.cell}-{tag}", timeout_s=120.0)
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
        run.update(times_s=[], losses=[], bubble=[], timing=[])
        t_first, cpu0 = t_first or time.monotonic(), cpu_self_s()
        for x, y in batches:
            s0 = time.perf_counter()
            part = x[lo : lo + per]
            loss = model.train_on_batch({"input_ids": part} if llama else part, y[lo : lo + per])
            run["times_s"].append(time.perf_counter() - s0)
            run["losses"].append(loss)
            run["bubble"].append(pipe.last_bubble_fraction)
            run["timing"].append(dict(pipe.last_timing))
        run["cpu_s"] = cpu_self_s() - cpu0
        run["theoretical_fraction"] = pipe.theoretical_bubble_fraction
        run["paper_ratio"] = pipe.paper_bubble_ratio
        runs.append(run)
    t_first = t_first or time.monotonic()
    phases = {
        "setup": round(t_first - t_start, 2),  # the first model's; later ones count as train
        "train": round(time.monotonic() - t_first, 2),
    }
    emit("RESULT", {"rank": a.rank, "runs": runs, "phases_s": phases})
    wait_exit_then_close(clients, server)


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
    times, losses = [], []
    t_setup, cpu0 = time.monotonic(), cpu_self_s()
    for x, y in batches:
        s0 = time.perf_counter()
        losses.append(step(x[rows], y[rows]))
        times.append(time.perf_counter() - s0)
    t_train = time.monotonic()
    phases = {"setup": round(t_setup - t_start, 2), "train": round(t_train - t_setup, 2)}
    run = {"micro_batches": int(a.micro_batches), "times_s": times, "losses": losses}
    run["cpu_s"] = cpu_self_s() - cpu0
    emit("RESULT", {"rank": a.rank, "runs": [run], "phases_s": phases})
    if not single:
        end_gloo()


# ================================================================================ the parent
def build_model(family: str, model: str) -> Any:
    """The example GPT or the HF Llama (``benchmarks._llama_stages``) of size ``model``,
    seeded: the same on every rank and on both sides."""
    if family == "llama":
        from benchmarks._llama_stages import build_llama

        return build_llama(model)
    return build_gpt(model)


def layout(family: str, cell: str, world: int, model: str) -> tuple[int, int, int] | str:
    """(pp, tp, dp) of ``cell`` at ``world`` ranks, or why it does not apply."""
    if family == "llama":
        from benchmarks._llama_stages import llama_layout

        return llama_layout(cell, world)
    n_layer, n_head = (MODELS[model]["overrides"][k] for k in ("n_layer", "n_head"))
    if cell in ("pp_gpipe", "pp_1f1b"):
        if not 2 <= world <= n_layer:
            return f"a pipeline of {world} stages needs 2..{n_layer} (n_layer) ranks"
        return world, 1, 1
    if cell == "tp":
        if world < 2 or n_head % world:
            return f"tensor parallelism over {world} ranks needs n_head ({n_head}) % W == 0"
        return 1, world, 1
    if world % 4:
        return f"3d = (2, 2, W/4) needs W divisible by 4, not {world}"
    return 2, 2, world // 4


def run_ranks(
    side: str,
    cell: str,
    model: str,
    world: int,
    sizes: tuple[int, int, int],
    micro: list[int],
    schedule: str,
    steps: int,
    a: argparse.Namespace,
    family: str = "gpt",
) -> list[dict[str, Any]]:
    """Every rank's RESULT of one (side, cell, family, model, W), in rank order."""
    budget = STARTUP_S + steps * len(micro) * MODELS[model]["step_budget_s"] * SLOWER[family]
    argv = ["--model", model, "--world", str(world), "--steps", str(steps), "--cell", cell]
    argv += ["--family", family]
    argv += ["--pp", str(sizes[0]), "--tp", str(sizes[1]), "--dp", str(sizes[2])]
    argv += ["--schedule", schedule, "--micro-batches", ",".join(map(str, micro))]
    if side == "torch":
        n = 1 if cell == "single" else world
        argv += ["--port", str(free_port())]
        label, mode, hosted = f"torch-{cell}", "_torch", False
    else:
        argv += ["--run", f"h{uuid.uuid4().hex[:10]}"]
        n, label, mode, hosted = world, cell, "_ours", True
    return measured(
        a.wait_quiet,
        log,
        lambda: launch_ranks(
            "benchmarks.hybrid",
            mode,
            label,
            n,
            argv,
            budget,
            tuned=hosted,  # ours with MALLOC_ENV (as benchmarks.strategies), gloo plain
            hosted_servers=hosted,
            log=log,
        ),
    )


def run_view(results: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    """Each rank's ``i``-th run (one value of m), with the rank's other fields."""
    return [{**r["runs"][i], "rank": r["rank"], "foreign": r["foreign_cpu_frac"]} for r in results]


def _med(values: list[float], warmup: int) -> float:
    return statistics.median(values[warmup:] or values)


def cpu_ms_per_step(ranks: list[dict[str, Any]]) -> float:
    """CPU ms per step summed over the ranks (ours: with their in-process servers), over all
    steps, warm-up included: steadier than wall time on a shared 2-core machine."""
    return round(sum(r["cpu_s"] for r in ranks) / len(ranks[0]["times_s"]) * 1e3, 1)


def bubble_summary(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per rank (stage): the measured bubble against the theory (see NOTES["bubble"])."""
    rows = []
    for r in ranks:
        timing = r["timing"]
        idle = [(t["wall_s"] - t["compute_s"]) / max(t["compute_s"], 1e-9) for t in timing]
        pp, tp, dp = r["coords"]
        rows.append(
            {
                "rank": r["rank"],
                "stage": pp,
                "tp_rank": tp,
                "dp_rank": dp,
                "measured_fraction": round(_med(r["bubble"], warmup), 3),
                "measured_idle_over_compute": round(_med(idle, warmup), 3),
                "compute_ms": round(_med([t["compute_s"] for t in timing], warmup) * 1e3, 1),
                "comm_ms": round(_med([t["comm_s"] for t in timing], warmup) * 1e3, 1),
                "wall_ms": round(_med([t["wall_s"] for t in timing], warmup) * 1e3, 1),
            }
        )
    first = ranks[0]
    return {
        "micro_batches": first["micro_batches"],
        "stages": max(r["stage"] for r in rows) + 1,
        "measured_fraction_mean": round(statistics.mean(r["measured_fraction"] for r in rows), 3),
        "theoretical_fraction": round(first["theoretical_fraction"], 3),
        "measured_idle_over_compute_mean": round(
            statistics.mean(r["measured_idle_over_compute"] for r in rows), 3
        ),
        "paper_ratio": round(first["paper_ratio"], 3),
        "per_stage": rows,
    }


def cell_row(
    family: str,
    model: str,
    world: int,
    cell: str,
    warm: int,
    ref: list[float] | None,
    single_ms: float | None,
    a: argparse.Namespace,
) -> dict[str, Any]:
    sizes = layout(family, cell, world, model)
    row: dict[str, Any] = {"family": family, "model": model, "world_size": world, "cell": cell}
    name = f"{family} {model} W={world}"
    if isinstance(sizes, str):
        log(f"{name}: {cell} skipped: {sizes}")
        return {**row, "skipped": sizes, "error": None}
    m = (a.micro_batches or 2 * sizes[0]) if sizes[0] > 1 else 1
    row.update(layout=dict(zip(("pp", "tp", "dp"), sizes, strict=True)), micro_batches=m)
    row.update(schedule=SCHEDULE[cell] if sizes[0] > 1 else None)
    row["torch"] = TORCH_LABEL[family][cell] + (" + dp grad all-reduce" * (sizes[2] > 1))
    log(f"{name}: torch {cell} {row['layout']} m={m}")
    args = (model, world, sizes, [m], SCHEDULE[cell], a.steps_for[model], a, family)
    tres, terr = attempt_cell(f"torch {cell}", log, lambda: run_ranks("torch", cell, *args))
    log(f"{name}: ours {cell}")
    ores, oerr = attempt_cell(f"ours {cell}", log, lambda: run_ranks("ours", cell, *args))
    row.update(ours_ms=None, torch_ms=None, ratio=None, error=oerr or terr)
    row["first_step_loss"] = first = {"single": ref[0] if ref else None}
    if tres:
        tv = run_view(tres, 0)
        row["torch_ms"], row["torch_step_ms"] = median_ms(tv, warm)
        row["torch_loss_rel_diff_vs_single"] = max_rel_diff(mean_losses(tv), ref)
        first["torch"] = mean_losses(tv)[0]
        row["torch_foreign_cpu_frac"] = tv[0]["foreign"]
        row["torch_cpu_ms_per_step"] = cpu_ms_per_step(tv)
    if ores:
        ov = run_view(ores, 0)
        row["ours_ms"], row["ours_step_ms"] = median_ms(ov, warm)
        row["loss_rel_diff_vs_single"] = max_rel_diff(mean_losses(ov), ref)
        first["ours"] = mean_losses(ov)[0]
        row["ours_vs_single"] = round(row["ours_ms"] / single_ms, 2) if single_ms else None
        row["ours_foreign_cpu_frac"] = ov[0]["foreign"]
        row["ours_cpu_ms_per_step"] = cpu_ms_per_step(ov)
        if sizes[0] > 1:
            row["bubble"] = bubble_summary(ov, warm)
    if row["ours_ms"] and row["torch_ms"]:
        row["ratio"] = round(row["ours_ms"] / row["torch_ms"], 2)
        first["ours_vs_torch_rel_diff"] = max_rel_diff([first["ours"]], [first["torch"]])
    b = row.get("bubble")
    log(
        f"    ours {row['ours_ms']} ms, torch {row['torch_ms']} ms, ratio {row['ratio']},"
        f" loss diff {row.get('loss_rel_diff_vs_single')}"
        + (f"; bubble {b['measured_fraction_mean']} vs {b['theoretical_fraction']}" if b else "")
    )
    return row


def sweep(
    model: str, stages: int, a: argparse.Namespace, schedule: str = "1f1b"
) -> list[dict[str, Any]]:
    """Ours alone, ``stages`` ranks, every m of SWEEP_MICRO the schedule allows (interleaved:
    multiples of the stages, 2 chunks per rank) in one launch."""
    micro = [m for m in SWEEP_MICRO if schedule != "interleaved_1f1b" or m % stages == 0]
    steps = 3 if a.quick else min(8, a.steps_for[model])
    warm = 1 if steps <= 3 else 2
    log(f"{model}: bubble sweep, {schedule}, {stages} stages, m in {micro}, {steps} steps")
    res, err = attempt_cell(
        f"sweep {schedule} p={stages}",
        log,
        lambda: run_ranks(
            "ours", "sweep", model, stages, (stages, 1, 1), micro, schedule, steps, a
        ),
    )
    rows = []
    for i, m in enumerate(micro):
        row: dict[str, Any] = {"model": model, "stages": stages, "micro_batches": m}
        row.update(schedule=schedule, global_batch=stages * MODELS[model]["batch_per_rank"])
        if res:
            view = run_view(res, i)
            row["ours_ms"] = median_ms(view, warm)[0]
            row.update(bubble_summary(view, warm))
            row["foreign_cpu_frac"] = view[0]["foreign"]
            log(
                f"    p={stages} m={m}: {row['ours_ms']} ms, bubble"
                f" {row['measured_fraction_mean']} (theory {row['theoretical_fraction']}),"
                f" idle/compute {row['measured_idle_over_compute_mean']}"
                f" (paper {row['paper_ratio']})"
            )
        row["error"] = err
        rows.append(row)
    return rows


def single_row(
    family: str, m: str, w: int, warm: int, a: argparse.Namespace
) -> tuple[dict[str, Any], list[float] | None, float | None]:
    """Single-process training on the whole global batch: (row, losses, median step ms)."""
    log(f"{family} {m} W={w}: torch single (global batch {w * MODELS[m]['batch_per_rank']})")
    single, err = attempt_cell(
        "single",
        log,
        lambda: run_ranks("torch", "single", m, w, (1, 1, 1), [1], "-", a.steps_for[m], a, family),
    )
    sv = run_view(single, 0) if single else None
    ref = sv[0]["losses"] if sv else None
    single_ms = median_ms(sv, warm)[0] if sv else None
    row = {"family": family, "model": m, "world_size": w, "cell": "single"}
    row.update(torch=TORCH_LABEL[family]["single"], ours_ms=None, torch_ms=single_ms, ratio=None)
    row.update(torch_step_ms=median_ms(sv, warm)[1] if sv else None, losses=ref, error=err)
    return row, ref, single_ms


def parent_main(a: argparse.Namespace) -> int:
    install_cleanup()
    models, worlds = models_and_worlds(a, [4])
    cells = parse_list(a.cells)
    for c in cells:
        if c not in CELLS:
            raise SystemExit(f"unknown cell {c!r}; choose from {', '.join(CELLS)}")
    families = FAMILIES[a.family]
    if "llama" in families and importlib.util.find_spec("transformers") is None:
        if a.family == "llama":
            raise SystemExit("--family llama needs transformers (pip install -e '.[dev]')")
        log("transformers is not installed: the Llama cells are left out")
        families = ("gpt",)
    a.steps_for, warmups = steps_and_warmup(a, models, 6, 2)
    t_start, load = time.time(), Load().start()
    import torch  # only for the version

    out: dict[str, Any] = {
        "benchmark": "hybrid",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "notes": NOTES,
        "models": {m: model_info(m, a.steps_for[m], warmups[m]) for m in models},
        "results": [],
        "bubble_sweep": [],
    }
    out["host"]["torch"] = torch.__version__
    if "llama" in families:
        from benchmarks._llama_stages import llama_info

        out["llama_models"] = {m: llama_info(m) for m in models}
    for m in models:
        warm = warmups[m]
        for w in worlds:
            for family in families:
                row, ref, single_ms = single_row(family, m, w, warm, a)
                out["results"].append(row)
                for c in cells:
                    out["results"].append(cell_row(family, m, w, c, warm, ref, single_ms, a))
        if not a.no_sweep and "gpt" in families:
            for p in SWEEP_STAGES:
                out["bubble_sweep"] += sweep(m, p, a)
            # interleaved: 2 chunks per rank, so p x 2 virtual stages of at least one block
            for p in (q for q in SWEEP_STAGES if 2 * q <= MODELS[m]["overrides"]["n_layer"]):
                out["bubble_sweep"] += sweep(m, p, a, "interleaved_1f1b")
    out["wall_s"] = round(time.time() - t_start, 1)
    out["foreign_cpu_frac"] = load.stop()
    failed = [r for r in out["bubble_sweep"] if r.get("error")]
    return print_report(out) or (1 if failed else 0)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cells", default=",".join(CELLS), help="default: %(default)s")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=0,
        help="m of the pipeline cells, both sides (default: 2 x stages)",
    )
    p.add_argument(
        "--family",
        default="both",
        choices=list(FAMILIES),
        help="the example GPT, HF LlamaForCausalLM or both (default: %(default)s)",
    )
    p.add_argument("--no-sweep", action="store_true", help="skip the bubble sweep (GPT only)")


def main(argv: list[str] | None = None) -> int:
    return run_main(
        argv,
        __doc__,
        {"_ours": ours_main, "_torch": torch_main},
        (
            ["--cell", "--run", "--schedule", "--micro-batches", "--family"],
            ["--pp", "--tp", "--dp"],
        ),
        "tiny, W=4, 6 steps, a 3-step sweep, GPT and Llama (< 5 minutes)",
        "tiny",
        "4",
        options,
        parent_main,
    )


if __name__ == "__main__":
    sys.exit(main())
