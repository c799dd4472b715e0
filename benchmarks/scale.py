"""Training at the sizes users train: GPT-2 124M and 355M, a Llama-shaped 1B, against torch.

    python -m benchmarks.scale [--quick] [--models gpt2-124m,gpt2-355m,llama-1b]
                               [--world-sizes 2,4,8] [--strategies ddp,zero1,zero2,fsdp]
                               [--steps N] [--warmup K] [--wait-quiet S] [--margin-gib G]
                               [--no-compute] [--compute-beside]

For every model, W and strategy, in one run: ours with W rank processes against W separate
``paramshard serve`` processes on this host (the deployed shape: payloads through shared
memory), and torch's twin on gloo with W rank processes: DDP against
``DistributedDataParallel``, ZeRO-1 and ZeRO-2 against DDP + ``ZeroRedundancyOptimizer``
(torch's one optimizer-state sharding), FSDP against
FSDP2 ``fully_shard`` per block + root. Same model and seed, same batches (W x 2 sequences of
128 tokens), AdamW, float32, one intra-op thread per rank on both sides (models and formulas:
``benchmarks/_scale_models.py``; ranks: ``benchmarks/_scale_ranks.py``).

Reported per cell:

- **step time**: per step the slowest rank's; the median after the warm-up steps; ours / torch;
- **where ours spends it** (medians over the timed steps, rank 0): forward, backward,
  optimizer step; the training thread's waits on the servers by kind and the background
  threads' time in calls (``model.comm_times``: strategies/timing.py); the slowest server's
  optimizer step (its Status); compute = step - waits; Python's garbage collection (``gc``,
  torch's ranks too); the training thread's CPU in forward, backward and optimizer step
  (``main_cpu/...``, both sides: against the compute alone, what the training thread spends
  beyond it, where wall times also hold the time other processes held the cores); the rank
  process's minor page faults a step, in thousands (``minor_faults_k``: memory freed and
  touched afresh each step, which the kernel zeroes);
- **CPU a step**, both sides (medians over the timed steps): the CPU seconds of all the rank
  processes together, and ours' servers' (``cpu_per_step_s``): with more processes than
  cores, a step's time follows the CPU both sides spend; and a rank's by kind of thread
  (``rank_threads_cpu_s``, the mean over ranks: the training thread ``main``, the strategy's
  background threads, grpc's and gloo's), which says whether CPU beyond the compute alone
  is spent in the training thread or beside it; ours' servers' by kind of thread, all
  servers together (``server_threads_cpu_s``: ``session``, the calls of sessions; ``shard``,
  grpc's handlers; ``python``, grpc's poller);
- **memory**: the peak resident memory (VmHWM) of every trainer and every server, against the
  formula (model state per process, as the strategy divides it, ``_scale_models.formula``)
  plus the measured resident memory of a bare process (``process_overhead``); trainers also
  against torch's ranks' peak; each server's own memory (RssAnon) and the trainers' shared
  segments it maps (RssShmem) at their peaks, sampled every 0.1 s (``ServerSampler``: VmHWM
  counts a segment in both processes that map it);
- **losses**: the largest relative difference between ours and torch's per-step mean loss;
- **compute alone** (``compute_reference``, once a model; ``--no-compute`` skips it): one
  process, no peers and no servers, the model and plain AdamW on one rank's batch: forward,
  backward and optimizer step, its CPU and minor page faults a step (medians after the
  warm-up).
  ``benchmarks.cost_model --scale`` predicts every cell's step from it and the costs of a
  message and a byte (benchmarks/_cost_steps.py);
- **compute alone beside the cell** (``compute_beside``, with ``--compute-beside``): the same
  measured again between the cell's two sides. A machine whose pace moves between runs, or
  within one, moves the compute alone with it (this 2-core machine's took 2.8 to 6.2 s a step
  in three runs of GPT-2 124M); measured beside each cell, it is the pace the cell ran at.

Before each cell the benchmark estimates its memory (formula + overhead + activations + a
transient allowance, ``estimate``) and skips the cell with the reason when MemAvailable less
``--margin-gib`` cannot hold it, rather than swap or be killed. Each cell records
``/proc/loadavg`` at its start and the share of the CPUs other processes used meanwhile.

``--quick``: a 0.1M-parameter GPT-2, W = 2, every strategy, 5 steps (seconds per cell).
JSON to stdout, progress to stderr; every child is started here and stopped by PID.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from typing import Any

from benchmarks._cpu import Load, wait_quiet
from benchmarks._processes import free_port, install_cleanup, logger, serve_processes, stop_all
from benchmarks._scale_memory import (
    GiB,
    ServerSampler,
    estimate,
    gathered_units_from_shape,
    loadavg,
    machine,
    meminfo,
    memory,
    param_count,
    process_overhead,
    write_report,
)
from benchmarks._scale_models import MODELS
from benchmarks._scale_ranks import compute_main, ours_main, overhead_main, rss_kinds, torch_main
from benchmarks._scale_summary import (
    breakdown,
    cpu_per_step,
    rank_threads_cpu,
    server_threads_cpu,
    step_ms,
)
from benchmarks._training import launch_ranks, mean_losses
from paramshard.client.chunk_size import default_chunk_bytes
from paramshard.client.rpc import MAX_IN_FLIGHT

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
TORCH_PEER = {
    "ddp": "DistributedDataParallel",
    "zero1": "DistributedDataParallel + ZeroRedundancyOptimizer(AdamW)",
    "zero2": "DistributedDataParallel + ZeroRedundancyOptimizer(AdamW)",
    "fsdp": "fully_shard per block + root (FSDP2)",
}
log = logger("scale")


# ================================================================================ one cell
def run_side(side: str, model: str, strategy: str, w: int, a: argparse.Namespace) -> dict:
    """One side of one cell: every rank's RESULT, and (ours) every server's peak RSS."""
    budget = 180.0 + a.steps_for[model] * a.step_budget
    argv = ["--model", model, "--strategy", strategy, "--world", str(w)]
    argv += ["--steps", str(a.steps_for[model])]
    argv += ["--bucket-views"] if a.bucket_views else []
    if side == "torch":
        argv += ["--port", str(free_port())]
        ranks = launch_ranks(
            "benchmarks.scale", "_torch", f"torch-{strategy}", w, argv, budget,
            tuned=False, hosted_servers=False, log=log,
        )  # fmt: skip
        return {"ranks": ranks}
    servers: list[Any] = []
    try:
        servers, addresses = serve_processes(w, 120)
        argv += ["--servers", ",".join(addresses), "--run", f"s{uuid.uuid4().hex[:10]}"]
        argv += ["--chunk-mib", str(a.chunk_mib), "--in-flight", str(a.in_flight)]
        argv += ["--arrival-order"] if a.arrival_order else []
        argv += ["--server-pids", ",".join(str(k.proc.pid) for k in servers)]
        with ServerSampler([k.proc.pid for k in servers]) as sampled:
            ranks = launch_ranks(
                "benchmarks.scale", "_ours", f"ours-{strategy}", w, argv, budget,
                tuned=a.trainer_env == "launch", hosted_servers=False, log=log, watch=servers,
                send_exit=True,
            )  # fmt: skip
        server_rss = [rss_kinds(k.proc.pid) for k in servers]
        return {
            "ranks": ranks,
            "server_peak_rss_bytes": [r["VmHWM"] for r in server_rss],
            "server_peak_anon_bytes": sampled.anon,
            "server_peak_shmem_bytes": sampled.shmem,
            "server_rss_at_end": server_rss,
        }
    finally:
        stop_all(servers)


def run_cell(model: str, strategy: str, w: int, a: argparse.Namespace, over: dict) -> dict:
    psi = param_count(model)
    units = gathered_units_from_shape(model, psi)
    row: dict[str, Any] = {"model": model, "world_size": w, "strategy": strategy}
    row["torch"] = TORCH_PEER[strategy]
    need = {s: estimate(model, strategy, s, psi, w, over) for s in ("torch", "ours")}
    row["estimate_gib"] = {s: round(v / GiB, 2) for s, v in need.items()}
    sides: dict[str, dict] = {}
    order = [x for x in ("torch", "ours") if x in a.sides]

    def too_big(side: str) -> str | None:
        avail = meminfo("MemAvailable") - int(a.margin_gib * GiB)
        if need[side] <= avail:
            return None
        return (
            f"{side}: needs about {need[side] / GiB:.1f} GiB (estimate), MemAvailable less"
            f" the {a.margin_gib:g} GiB margin is {avail / GiB:.1f} GiB"
        )

    # every side before either runs (one side alone compares nothing and takes its time),
    # then each again just before it runs (other processes may have taken memory since)
    early = next((why for side in order if (why := too_big(side))), None)
    for side in order if a.order_index % 2 == 0 else order[::-1]:
        if (why := early or too_big(side)) is not None:
            row["skipped"] = why
            log(f"  skipped: {row['skipped']}")
            return row
        if a.wait_quiet > 0:
            row[f"{side}_busy_before"] = wait_quiet(a.wait_quiet)
        row[f"{side}_loadavg_at_start"] = loadavg()
        log(f"{model} W={w} {strategy}: {side}")
        try:
            with Load() as load:
                sides[side] = run_side(side, model, strategy, w, a)
        except Exception as exc:  # noqa: BLE001 - one failed cell must not end the run
            row["error"] = f"{side}: {type(exc).__name__}: {exc}"
            log(f"  FAILED: {row['error']}")
            return row
        row[f"{side}_foreign_cpu_frac"] = load.foreign
        row[f"{side}_steal_frac"] = load.steal
        if a.compute_beside and len(sides) == 1:  # between the two sides
            row["compute_beside"] = compute_reference(model, psi, a, over)
    a.order_index += 1
    warm = a.warmup_for[model]
    for side, got in sides.items():
        row[f"{side}_ms"] = step_ms(got["ranks"], warm)
        row[f"{side}_breakdown_ms"] = breakdown(got["ranks"][0], warm)
        row[f"{side}_cpu_per_step_s"] = cpu_per_step(got["ranks"], warm)
        row[f"{side}_rank_threads_cpu_s"] = rank_threads_cpu(got["ranks"], warm)
        if side == "ours" and (servers := server_threads_cpu(got["ranks"], warm)):
            row["ours_server_threads_cpu_s"] = servers
        row[f"{side}_memory"] = memory(got, strategy, side, psi, w, over, units)
    if len(sides) < 2:  # --sides: one side only (a knob's effect on ours, say)
        log("  " + ", ".join(f"{k} {row[k + '_ms']} ms" for k in sides))
        return row
    ours, theirs = sides["ours"], sides["torch"]
    row["ratio"] = round(row["ours_ms"] / row["torch_ms"], 3)
    lo, lt = mean_losses(ours["ranks"]), mean_losses(theirs["ranks"])
    row["loss_max_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(lo, lt, strict=True))
    ours_peak = max(row["ours_memory"]["trainer_peak_rss_mb"])
    row["trainer_peak_vs_torch"] = round(
        ours_peak / max(row["torch_memory"]["trainer_peak_rss_mb"]), 3
    )
    log(
        f"  ours {row['ours_ms']} ms, torch {row['torch_ms']} ms, ratio {row['ratio']};"
        f" trainer peak vs torch {row['trainer_peak_vs_torch']};"
        f" server/formula {row['ours_memory'].get('server_ratio_to_formula')}"
    )
    return row


def compute_reference(model: str, psi: int, a: argparse.Namespace, over: dict) -> dict[str, Any]:
    """Median ms a step of one rank's compute alone (``_scale_ranks.compute_main``), ``psi``
    the model's parameters."""
    need = estimate(model, "ddp", "torch", psi, 1, over)
    avail = meminfo("MemAvailable") - int(a.margin_gib * GiB)
    if need > avail:
        return {"skipped": f"needs about {need / GiB:.1f} GiB, {avail / GiB:.1f} GiB free"}
    out: dict[str, Any] = {}
    if a.wait_quiet > 0:
        out["busy_before"] = wait_quiet(a.wait_quiet)
    log(f"{model}: compute alone")
    argv = ["--model", model, "--world", "1", "--steps", str(a.steps_for[model])]
    budget = 180.0 + a.steps_for[model] * a.step_budget
    try:
        with Load() as load:
            (rank,) = launch_ranks(
                "benchmarks.scale", "_compute", "compute", 1, argv, budget,
                tuned=False, hosted_servers=False, log=log,
            )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the cells still run
        return {**out, "error": f"{type(exc).__name__}: {exc}"}
    rows = rank["steps"][a.warmup_for[model] :]
    for key in ("s", "forward", "backward", "optimizer", "cpu"):  # a step row's keys
        name = "step" if key == "s" else key
        out[f"{name}_ms"] = round(statistics.median(r[key] for r in rows) * 1e3, 1)
    out["minor_faults_k"] = round(statistics.median(r["minor_faults"] for r in rows) / 1e3)
    out["foreign_cpu_frac"], out["steal_frac"] = load.foreign, load.steal
    return out


# ================================================================================ main
def parent_main(a: argparse.Namespace) -> int:
    install_cleanup()
    models = ["quick"] if a.quick else [m.strip() for m in a.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    worlds = [2] if a.quick else [int(x) for x in a.world_sizes.split(",") if x.strip()]
    strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]
    for s in strategies:
        if s not in STRATEGIES:
            raise SystemExit(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
    a.steps_for = {m: a.steps or MODELS[m].steps for m in models}
    a.warmup_for = {m: MODELS[m].warmup if a.warmup is None else a.warmup for m in models}
    for m in models:
        if a.warmup_for[m] >= a.steps_for[m]:
            raise SystemExit(f"--steps ({a.steps_for[m]}) must exceed --warmup")
    a.order_index = 0
    a.sides = [x.strip() for x in a.sides.split(",") if x.strip()]
    if not a.sides or set(a.sides) - {"torch", "ours"}:
        raise SystemExit("--sides takes torch and/or ours")
    out: dict[str, Any] = {
        "benchmark": "scale",
        "command": " ".join(sys.argv),
        "machine": machine(),
    }
    out["machine"]["loadavg_at_start"] = loadavg()
    out["client"] = {
        "chunk_mib": a.chunk_mib or None,  # None: each W's default, chunk_mib_by_world
        "max_in_flight": a.in_flight or MAX_IN_FLIGHT,
        "contribute_read": True,  # one call a chunk read back: benchmarks/_cost_counts.py
    }
    if not a.chunk_mib:
        out["client"]["chunk_mib_by_world"] = {
            str(w): default_chunk_bytes(w) / 2**20 for w in worlds
        }
    out["trainer_env"] = a.trainer_env
    out["deterministic"] = not a.arrival_order
    out["gradient_as_bucket_view"] = a.bucket_views
    out["process_overhead"] = over = process_overhead(600)
    out["models"] = {
        m: {"n_params": param_count(m), "config": MODELS[m].config, "seq_len": MODELS[m].seq_len,
            "batch_per_rank": MODELS[m].batch_per_rank, "steps": a.steps_for[m],
            "warmup": a.warmup_for[m], "notes": MODELS[m].notes}
        for m in models
    }  # fmt: skip
    out["results"] = rows = []
    t0 = time.monotonic()
    if a.compute:
        out["compute_reference"] = {
            m: compute_reference(m, out["models"][m]["n_params"], a, over) for m in models
        }
    for m in models:
        for w in [w for w in worlds if w in MODELS[m].worlds]:
            for s in [s for s in strategies if s in MODELS[m].strategies]:
                rows.append(run_cell(m, s, w, a, over))
    out["wall_s"] = round(time.monotonic() - t0, 1)
    write_report(out)
    return 1 if any(r.get("error") for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ranks = {"_ours": ours_main, "_torch": torch_main, "_overhead": overhead_main}
    ranks["_compute"] = compute_main
    if argv and argv[0] in ranks:
        p = argparse.ArgumentParser()
        for k in ("--model", "--strategy", "--servers", "--run", "--server-pids"):
            p.add_argument(k, default="")
        for k in ("--world", "--rank", "--steps", "--port", "--in-flight"):
            p.add_argument(k, type=int, default=0)
        p.add_argument("--chunk-mib", type=float, default=0.0)
        p.add_argument("--arrival-order", action="store_true")
        p.add_argument("--bucket-views", action="store_true")
        p.add_argument("--lifetime", type=float, default=3600.0)
        ranks[argv[0]](p.parse_args(argv[1:]))
        return 0
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="0.1M-parameter GPT-2, W=2 (seconds)")
    p.add_argument("--models", default="gpt2-124m,gpt2-355m,llama-1b")
    p.add_argument("--world-sizes", default="2,4,8", help="each model runs those of its own")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--steps", type=int, default=0, help="per run, warm-up included")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--wait-quiet", type=float, default=0.0, help="seconds to wait for quiet CPUs")
    p.add_argument("--margin-gib", type=float, default=1.5, help="memory left free (GiB)")
    p.add_argument("--step-budget", type=float, default=300.0, help="seconds a step may take")
    p.add_argument(
        "--chunk-mib",
        type=float,
        default=0.0,
        help="ours: ShardClient chunk_bytes (default: the client's own for W servers on one"
        " host, client/chunk_size.py)",
    )
    p.add_argument(
        "--in-flight",
        type=int,
        default=0,
        help=f"ours: ShardClient max_in_flight (default {MAX_IN_FLIGHT})",
    )
    p.add_argument(
        "--sides", default="torch,ours", help="which sides run (default both: the ratio)"
    )
    p.add_argument(
        "--no-compute",
        dest="compute",
        action="store_false",
        help="skip each model's compute alone (one process, no peers: the cost model's input)",
    )
    p.add_argument(
        "--compute-beside",
        action="store_true",
        help="also measure the compute alone in every cell, between its two sides (the pace"
        " the cell ran at, for the cost model)",
    )
    p.add_argument(
        "--arrival-order",
        action="store_true",
        help="ours: ShardingConfiguration(deterministic=False): gradients summed as they arrive,"
        " no staging on the servers (not bitwise reproducible)",
    )
    p.add_argument(
        "--bucket-views",
        action="store_true",
        help="both sides' DDP keep gradients as views of their buckets (gradient_as_bucket_view:"
        " ours' DDPModel, torch's DDP, under its ZeRO twin too)",
    )
    p.add_argument(
        "--trainer-env",
        choices=("plain", "launch"),
        default="plain",
        help="our trainers' allocator settings: plain (as torch's ranks) or launch (the servers'"
        " MALLOC_ENV, which `paramshard launch` gives its ranks too)",
    )
    return parent_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
