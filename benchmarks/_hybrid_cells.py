"""benchmarks/hybrid.py's cells: a cell's (pp, tp, dp) layout, its ranks run for ours and for torch,
and the row it reports (step times, CPU, bubble against theory, losses), the micro-batch sweep
and the single-process reference."""

from __future__ import annotations

import argparse
import statistics
import uuid
from typing import Any

from benchmarks._processes import (
    free_port,
    logger,
)
from benchmarks._training import (
    MODELS,
    STARTUP_S,
    attempt_cell,
    launch_ranks,
    max_rel_diff,
    mean_losses,
    measured,
    median_ms,
)

SCHEDULE = {"pp_gpipe": "gpipe", "pp_1f1b": "1f1b", "tp": "1f1b", "3d": "gpipe"}


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


SWEEP_MICRO = (1, 2, 4, 8)


log = logger("hybrid")


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


def optimizer_ms(ranks: list[dict[str, Any]], warmup: int) -> list[float]:
    """Each rank's median optimizer step after the warm-up, ms, in rank order: ours, its
    part's push, servers' step and pull; torch's, the dp gradient mean and AdamW."""
    ordered = sorted(ranks, key=lambda r: r["rank"])
    return [round(_med(r["optimizer_s"], warmup) * 1e3, 1) for r in ordered]


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
        row["torch_optimizer_ms"] = optimizer_ms(tv, warm)
    if ores:
        ov = run_view(ores, 0)
        row["ours_ms"], row["ours_step_ms"] = median_ms(ov, warm)
        row["loss_rel_diff_vs_single"] = max_rel_diff(mean_losses(ov), ref)
        first["ours"] = mean_losses(ov)[0]
        row["ours_vs_single"] = round(row["ours_ms"] / single_ms, 2) if single_ms else None
        row["ours_foreign_cpu_frac"] = ov[0]["foreign"]
        row["ours_cpu_ms_per_step"] = cpu_ms_per_step(ov)
        row["ours_optimizer_ms"] = optimizer_ms(ov, warm)
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
