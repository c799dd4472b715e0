"""Training-step time and memory of our strategies against PyTorch's own, on the same GPT.

    python -m benchmarks.strategies [--quick] [--models tiny,small] [--world-sizes 2,4]
                                    [--steps N] [--warmup K] [--server-mode process|inprocess|both]

For every model size and world size W, in one run (torch and ours interleaved, strategy by
strategy, so both sides see the same machine load):

- **ours**: ``DDPModel``, ``ZeRO1Model``, ``ZeRO2Model``, ``FSDPModel(wrap=(Block,))``, each with
  W trainer processes and W shard servers. Trainers are started with ``subprocess`` and have
  ``server.MALLOC_ENV`` in their environment before the interpreter starts. The servers are
  either one in-process ``ShardServer`` per trainer (``--server-mode inprocess``, the default:
  measured faster on this 2-core machine, see ``SERVER_MODE_NOTE``) or W
  ``python -m paramshard serve --port 0`` processes (``process``); ``both`` runs each strategy
  both ways.
- **torch** (gloo, same GPT, same batches, same AdamW): ``DistributedDataParallel``
  (``forward_sync_buffers=False``: the GPT's only buffer is a constant mask), ``DDP`` +
  ``ZeroRedundancyOptimizer(AdamW)``, FSDP2 ``fully_shard`` per ``Block`` + root, and FSDP2 with
  ``reshard_after_forward=False`` (torch's ZeRO-2) as the counterpart of our ZeRO-2; plus
  single-process training on the whole global batch (the numerical reference).

Models: ``paramshard.models.gpt.GPTConfig`` presets with overrides (the sizes every training
benchmark uses): tiny = ``GPTConfig.tiny(vocab_size=256, block_size=64, n_layer=4,
n_head=4, n_embd=128, tie_weights=False)``, 867,072 parameters, 8 sequences per rank; small =
``GPTConfig.small(vocab_size=4096, block_size=128, n_layer=6, n_head=6, n_embd=384,
tie_weights=False)``, 13,842,432 parameters, 4 sequences per rank. Untied, so the parameter counts
are the same on both sides. The global batch is W x per-rank batch, split evenly over the
ranks; batches are fixed random tokens (seeded per step, generated outside the timed region).

A step is ``zero_grad; loss = lm_loss(model(x), y); loss.backward(); opt.step()``. A step's
time is the slowest rank's; we report the median over the steps after ``--warmup``.

Memory per rank (bytes), measured in one extra, untimed step after the timed ones:
- trainer: parameters it holds (FSDP: ``model.peak_live_bytes``, the most gathered at once),
  the peak of gradient bytes held at once (gradient hooks registered before the strategy's own,
  so they see each gradient before a push frees it; ZeRO-2 also reports its largest bucket),
  and its torch optimizer's state;
- its server (index = rank): ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` of this job
  from ``client.status()``, and the server's reduction-slot bytes;
- total against docs/design.md §4's formula: DDP 16Ψ; ZeRO-1 8Ψ + 16Ψ/N; ZeRO-2 4Ψ + 16Ψ/N;
  FSDP 16Ψ/N + live units, where "live units" = 4 bytes x (root unit + two largest other units:
  the one computing and the one prefetched; the root stays gathered from the start of forward
  until its gradients are pushed at the end of backward);
- peak RSS of the trainer process (``resource.getrusage``), for context (it includes the
  server when the server is in-process).

JSON goes to stdout; progress to stderr. Every child process is started here, watches its
parent (it exits when the parent dies or its lifetime runs out) and is stopped by PID.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import uuid
from typing import Any

from benchmarks._cpu import Load, proc_cpu_s
from benchmarks._processes import (
    Child,
    free_port,
    install_cleanup,
    logger,
    serve_processes,
    stop_all,
)
from benchmarks._strategy_ranks import (
    ours_main,
    torch_main,
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
    model_info,
    models_and_worlds,
    print_report,
    run_main,
    steps_and_warmup,
)

OURS = ("ddp", "zero1", "zero2", "fsdp")
# our strategy -> the torch mode it is compared with
TORCH_PEER = {"ddp": "ddp", "zero1": "zero1", "zero2": "fsdp2_zero2", "fsdp": "fsdp2"}
TORCH_LABEL = {
    "single": "single process, whole global batch",
    "ddp": "DistributedDataParallel (gloo)",
    "zero1": "DDP + ZeroRedundancyOptimizer(AdamW)",
    "fsdp2_zero2": "fully_shard(reshard_after_forward=False) per Block + root",
    "fsdp2": "fully_shard per Block + root",
}
SERVER_MODE_NOTE = (
    "inprocess: a ShardServer in each trainer process; process: W `python -m paramshard serve"
    " --port 0` processes. Default inprocess: measured with --server-mode both on this idle"
    " 2-core machine, in-process servers were faster in 6 of 8 cells (tiny/small x"
    " ZeRO-1/ZeRO-2/FSDP at W=2, small ZeRO-1/FSDP at W=4; by 4-18%; slower by 4% and 14% in"
    " the other two) and used less CPU per step in all (no extra processes to schedule)."
)
log = logger("strategies")


# ----------------------------------------------------------------------------- ours
# ----------------------------------------------------------------------------- torch
# ----------------------------------------------------------------------------- summaries
def phase_ms(results: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """Rank 0's median forward / backward / optimizer-step milliseconds after warm-up."""
    rows = results[0]["phases"][warmup:] or results[0]["phases"]
    return {
        k: round(statistics.median(r[i] for r in rows) * 1e3, 2)
        for i, k in enumerate(("forward", "backward", "step"))
    }


def cpu_ms_per_step(results: list[dict[str, Any]], steps: int) -> dict[str, float]:
    """CPU milliseconds per step summed over ranks (timed steps, warm-up included) and, for
    ours with server processes, over the servers (whole run / (steps + 1): an upper bound)."""
    out = {"trainers": round(sum(r["cpu_s"] for r in results) / steps * 1e3, 1)}
    if results[0].get("servers_cpu_s"):
        out["servers"] = round(results[0]["servers_cpu_s"] / (steps + 1) * 1e3, 1)
    return out


def formula_bytes(strategy: str, psi: int, n: int, extra: dict[str, Any]) -> tuple[int, str]:
    if strategy == "ddp":
        return 16 * psi, "16Ψ"
    if strategy == "zero1":
        return 8 * psi + 16 * psi // n, "8Ψ + 16Ψ/N"
    if strategy == "zero2":
        return 4 * psi + 16 * psi // n, "4Ψ + 16Ψ/N"
    live = extra.get("root_unit_bytes", 0) + sum(extra.get("largest_units_bytes", []))
    return 16 * psi // n + live, "16Ψ/N + live units (root + 2 largest units, 4 B each)"


def memory_rows(strategy: str, results: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        psi = r["n_params"]
        trainer, srv = r["trainer"], r["server"]
        t_total = sum(trainer.values())
        s_total = srv["param_bytes"] + srv["grad_bytes"] + srv["optimizer_bytes"]
        formula, text = formula_bytes(strategy, psi, n, r["extra"])
        total = t_total + s_total
        rows.append(
            {
                "rank": r["rank"],
                "trainer": trainer,
                "server": srv,
                "total_bytes": total,
                "formula": text,
                "formula_bytes": formula,
                "ratio_to_formula": round(total / formula, 3),
                "peak_rss_mb": round(r["peak_rss_bytes"] / 2**20, 1),
                **r["extra"],
            }
        )
    return rows


def torch_memory(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"rank": r["rank"], **r["trainer"], "peak_rss_mb": round(r["peak_rss_bytes"] / 2**20, 1)}
        for r in results
    ]


def run_cell(
    side: str,
    strategy: str,
    model: str,
    world: int,
    a: argparse.Namespace,
    server_mode: str = "inprocess",
) -> list[dict[str, Any]]:
    """Runs one (side, strategy, model, W); returns every rank's RESULT in rank order, each
    with ``foreign_cpu_frac``: the share of the CPUs other processes used meanwhile."""
    return measured(
        a.wait_quiet, log, lambda: _run_cell(side, strategy, model, world, a, server_mode)
    )


def _run_cell(
    side: str, strategy: str, model: str, world: int, a: argparse.Namespace, server_mode: str
) -> list[dict[str, Any]]:
    steps = a.steps_for[model]
    budget = STARTUP_S + (steps + 1) * MODELS[model]["step_budget_s"]
    argv = ["--model", model, "--world", str(world), "--steps", str(steps)]
    argv += ["--strategy", strategy]
    if side == "torch":
        n = 1 if strategy == "single" else world
        return launch_ranks(
            "benchmarks.strategies",
            "_torch",
            f"torch-{strategy}",
            n,
            [*argv, "--port", str(free_port())],
            budget,
            tuned=a.gloo_env == "tuned",
            hosted_servers=False,
            log=log,
        )
    argv += ["--run", f"b{uuid.uuid4().hex[:10]}"]
    if server_mode == "inprocess":
        return launch_ranks(
            "benchmarks.strategies",
            "_ours",
            strategy,
            world,
            argv,
            budget,
            tuned=True,
            hosted_servers=True,
            log=log,
        )
    servers: list[Child] = []
    try:
        servers, addresses = serve_processes(world, STARTUP_S)
        results = launch_ranks(
            "benchmarks.strategies",
            "_ours",
            strategy,
            world,
            [*argv, "--servers", ",".join(addresses)],
            budget,
            tuned=True,
            hosted_servers=False,
            log=log,
            watch=servers,
            send_exit=True,
        )
        # servers: CPU over the whole run (registration and the accounting step included)
        server_cpu = sum(proc_cpu_s(k.proc.pid) for k in servers)
        for r in results:
            r["servers_cpu_s"] = server_cpu
        return results
    finally:
        stop_all(servers)


def parent_main(a: argparse.Namespace) -> int:
    install_cleanup()
    models, worlds = models_and_worlds(a, [2])
    strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]
    for s in strategies:
        if s not in OURS:
            raise SystemExit(f"unknown strategy {s!r}; choose from {', '.join(OURS)}")
    modes = ["process", "inprocess"] if a.server_mode == "both" else [a.server_mode]
    a.steps_for, warmups = steps_and_warmup(a, models, 8, 3)

    t_start, load = time.time(), Load().start()
    out: dict[str, Any] = {
        "benchmark": "strategies",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "server_mode": a.server_mode,
        "server_mode_note": SERVER_MODE_NOTE,
        "gloo_env": a.gloo_env,
        "models": {},
        "results": [],
    }
    import torch  # only for the version and the parameter count

    out["host"]["torch"] = torch.__version__
    for m in models:
        out["models"][m] = model_info(m, a.steps_for[m], warmups[m])

    def attempt(label: str, *args: Any, **kw: Any) -> Any:
        return attempt_cell(label, log, lambda: run_cell(*args, a=a, **kw))

    for m in models:
        for w in worlds:
            warm = warmups[m]
            log(f"{m} (Ψ={out['models'][m]['n_params']:,}) W={w}: torch single")
            single, err = attempt("single", "torch", "single", m, w)
            ref_losses = single[0]["losses"] if single else None
            single_ms = median_ms(single, warm)[0] if single else None
            out["results"].append(
                {
                    "model": m,
                    "world_size": w,
                    "strategy": "single",
                    "torch": TORCH_LABEL["single"],
                    "ours_ms": None,
                    "torch_ms": single_ms,
                    "ratio": None,
                    "torch_step_ms": median_ms(single, warm)[1] if single else None,
                    "torch_phases_ms": phase_ms(single, warm) if single else None,
                    "torch_cpu_ms_per_step": cpu_ms_per_step(single, a.steps_for[m])
                    if single
                    else None,
                    "torch_memory": torch_memory(single) if single else None,
                    "torch_foreign_cpu_frac": single[0]["foreign_cpu_frac"] if single else None,
                    "error": err,
                }
            )
            for s in strategies:
                peer = TORCH_PEER[s]
                log(f"{m} W={w}: torch {peer}")
                tres, terr = attempt(f"torch {peer}", "torch", peer, m, w)
                torch_ms = median_ms(tres, warm)[0] if tres else None
                for mode in modes:
                    log(f"{m} W={w}: ours {s} (servers: {mode})")
                    ores, oerr = attempt(f"ours {s}", "ours", s, m, w, server_mode=mode)
                    row: dict[str, Any] = {
                        "model": m,
                        "world_size": w,
                        "strategy": s,
                        "server_mode": mode,
                        "torch": TORCH_LABEL[peer],
                        "ours_ms": None,
                        "torch_ms": torch_ms,
                        "ratio": None,
                        "ours_vs_single": None,
                        "error": oerr or terr,
                    }
                    if ores:
                        ms, steps_ms = median_ms(ores, warm)
                        losses = mean_losses(ores)
                        row.update(
                            ours_ms=ms,
                            ratio=round(ms / torch_ms, 2) if torch_ms else None,
                            ours_vs_single=round(ms / single_ms, 2) if single_ms else None,
                            ours_step_ms=steps_ms,
                            ours_phases_ms=phase_ms(ores, warm),
                            ours_cpu_ms_per_step=cpu_ms_per_step(ores, a.steps_for[m]),
                            loss_rel_diff_vs_single=max_rel_diff(losses, ref_losses),
                            memory=memory_rows(s, ores, w),
                            ours_foreign_cpu_frac=ores[0]["foreign_cpu_frac"],
                        )
                        log(
                            f"    ours {ms} ms, torch {torch_ms} ms, ratio {row['ratio']};"
                            f" memory/formula {row['memory'][0]['ratio_to_formula']}"
                        )
                    if tres:
                        row.update(
                            torch_step_ms=median_ms(tres, warm)[1],
                            torch_phases_ms=phase_ms(tres, warm),
                            torch_cpu_ms_per_step=cpu_ms_per_step(tres, a.steps_for[m]),
                            torch_loss_rel_diff_vs_single=max_rel_diff(
                                mean_losses(tres), ref_losses
                            ),
                            torch_memory=torch_memory(tres),
                            torch_foreign_cpu_frac=tres[0]["foreign_cpu_frac"],
                        )
                    out["results"].append(row)
    wall = time.time() - t_start
    out["wall_s"] = round(wall, 1)
    out["foreign_cpu_frac"] = load.stop()
    return print_report(out)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategies", default=",".join(OURS), help="default: %(default)s")
    p.add_argument(
        "--server-mode",
        choices=("process", "inprocess", "both"),
        default="inprocess",
        help="where our shard servers run (default: %(default)s)",
    )
    p.add_argument(
        "--gloo-env",
        choices=("plain", "tuned"),
        default="plain",
        help="torch ranks' environment: plain, or with MALLOC_ENV (default: plain)",
    )


def main(argv: list[str] | None = None) -> int:
    return run_main(
        argv,
        __doc__,
        {"_ours": ours_main, "_torch": torch_main},
        (["--strategy", "--run", "--servers"], []),
        "tiny model, W=2, 8 steps (< 2 minutes)",
        "tiny,small",
        "2,4",
        options,
        parent_main,
    )


if __name__ == "__main__":
    sys.exit(main())
