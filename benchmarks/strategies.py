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

Models: ``examples.gpt.GPTConfig`` presets with overrides that reproduce the anchors' GPTs
(/work/shared/anchors): tiny = ``GPTConfig.tiny(vocab_size=256, block_size=64, n_layer=4,
n_head=4, n_embd=128, tie_weights=False)``, 867,072 parameters, 8 sequences per rank; small =
``GPTConfig.small(vocab_size=4096, block_size=128, n_layer=6, n_head=6, n_embd=384,
tie_weights=False)``, 13,842,432 parameters, 4 sequences per rank. Untied, as the anchors', so the
parameter counts are identical. The global batch is W x per-rank batch, split evenly over the
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
- total against DESIGN section 4's formula: DDP 16Ψ; ZeRO-1 8Ψ + 16Ψ/N; ZeRO-2 4Ψ + 16Ψ/N;
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

from benchmarks._processes import (
    Child,
    Load,
    child_env,
    child_guard,
    cpu_self_s,
    emit,
    free_port,
    install_cleanup,
    logger,
    peak_rss_bytes,
    proc_cpu_s,
    stop_all,
)
from benchmarks._training import (
    ADAMW,
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
    print_report,
    run_main,
    set_threads,
    steps_and_warmup,
    wait_exit_then_close,
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


def tensor_bytes(t: Any) -> int:
    import torch

    if not isinstance(t, torch.Tensor):
        return 0
    if hasattr(t, "to_local"):  # DTensor: this rank's part
        t = t.to_local()
    return t.numel() * t.element_size()


def optimizer_state_bytes(opt: Any) -> int:
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's in .optim
    return sum(tensor_bytes(v) for st in inner.state.values() for v in st.values())


class GradTracker:
    """Peak bytes of ``.grad`` held at once over ``params``, sampled whenever a gradient has
    been accumulated. Registered before a strategy's own hooks, it runs first and so sees each
    gradient before the strategy pushes and frees it."""

    def __init__(self, params: list) -> None:
        self.params = params
        self.enabled = False
        self.peak = 0
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)

    def live(self) -> int:
        return sum(tensor_bytes(p.grad) for p in self.params if p.grad is not None)

    def _hook(self, _p: Any) -> None:
        if self.enabled:
            self.peak = max(self.peak, self.live())


def timed_steps(
    model: Any, opt: Any, loss_fn: Any, batches: list, rank: int, per: int
) -> tuple[list[float], list[float], list[list[float]]]:
    """Runs one training step per batch on this rank's rows; returns each step's seconds, each
    step's loss and each step's (forward, backward, optimizer step) seconds."""
    import torch

    times, losses, phases = [], [], []
    for x, y in batches:
        xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xs), ys)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        times.append(t3 - t0)
        phases.append([t1 - t0, t2 - t1, t3 - t2])
        losses.append(loss.detach())
    return times, [float(torch.as_tensor(v).item()) for v in losses], phases


# ----------------------------------------------------------------------------- ours
def ours_main(a: argparse.Namespace) -> None:
    t_start = time.monotonic()
    child_guard(a.lifetime)

    from client import ClusterSpec, ShardClient
    from examples.gpt import Block, lm_loss
    from strategies import (
        DDPModel,
        DDPOptimizer,
        FSDPModel,
        FSDPOptimizer,
        ShardingConfiguration,
        ZeRO1Model,
        ZeRO1Optimizer,
        ZeRO2Model,
        ZeRO2Optimizer,
    )

    set_threads(a.world)
    server = None
    if a.servers:
        addresses = a.servers.split(",")
    else:  # in-process: host one server, learn the others' addresses from the parent
        server, addresses = hosted_server()
    client = ShardClient(
        ClusterSpec(addresses), rank=a.rank, world_size=a.world, run_id=a.run, timeout_s=120.0
    )
    config = ShardingConfiguration(client, job=f"bench-{a.strategy}-{a.run}", timeout_s=120.0)
    gpt = build_gpt(a.model)
    n_params = gpt.num_params()
    classes = {
        "ddp": (DDPModel, DDPOptimizer),
        "zero1": (ZeRO1Model, ZeRO1Optimizer),
        "zero2": (ZeRO2Model, ZeRO2Optimizer),
        "fsdp": (FSDPModel, FSDPOptimizer),
    }
    model_cls, opt_cls = classes[a.strategy]
    model = (
        model_cls(gpt, config, wrap=(Block,)) if a.strategy == "fsdp" else model_cls(gpt, config)
    )
    params = [p for p in gpt.parameters() if p.requires_grad]
    tracker = GradTracker(params)  # before the optimizer: ZeRO-2 / FSDP hook in at attach
    inner = adamw(params)
    opt = opt_cls(inner, config)

    per = MODELS[a.model]["batch_per_rank"]
    batches = make_batches(a.model, a.world, a.steps + 1)
    t_setup, cpu0 = time.monotonic(), cpu_self_s()
    times, losses, phases = timed_steps(model, opt, lm_loss, batches[:-1], a.rank, per)
    t_train, cpu_timed = time.monotonic(), cpu_self_s() - cpu0

    # -- the untimed accounting step
    x, y = batches[-1]
    xs, ys = x[a.rank * per : (a.rank + 1) * per], y[a.rank * per : (a.rank + 1) * per]
    opt.zero_grad(set_to_none=True)
    tracker.enabled, tracker.peak = True, 0
    lm_loss(model(xs), ys).backward()
    grads_after_backward = tracker.live()
    opt.step()
    tracker.enabled = False
    grad_peak = max(tracker.peak, grads_after_backward)
    if a.strategy == "fsdp":
        param_bytes = int(model.peak_live_bytes)
    else:
        param_bytes = sum(tensor_bytes(p.data) for p in params)
    trainer = {
        "param_bytes": param_bytes,
        "grad_bytes": grad_peak,
        "optimizer_bytes": optimizer_state_bytes(inner),
    }
    extra: dict[str, Any] = {}
    if a.strategy == "zero2":
        extra["largest_bucket_bytes"] = max(4 * b.numel for b in model._buckets)
    if a.strategy == "fsdp":
        sizes = sorted((u.nbytes for u in model._unit_list[1:]), reverse=True)
        extra["root_unit_bytes"] = model._unit_list[0].nbytes
        extra["largest_units_bytes"] = sizes[:2]
    row = client.status()[a.rank]
    srv = {"param_bytes": 0, "grad_bytes": 0, "optimizer_bytes": 0}
    step_s = 0.0
    for job in row.get("jobs", []):
        if job.get("job") == config.job:
            for b in job.get("buffers", []):
                for k in srv:
                    srv[k] += int(b.get(k, 0))
                step_s += float(b.get("last_step_seconds", 0.0))
    srv["slot_bytes"] = int(row.get("slot_bytes", 0))
    extra["server_last_step_ms"] = round(step_s * 1e3, 2)
    emit(
        "RESULT",
        {
            "rank": a.rank,
            "n_params": n_params,
            "times_s": times,
            "phases": phases,
            "losses": losses,
            "trainer": trainer,
            "server": srv,
            "extra": extra,
            "peak_rss_bytes": peak_rss_bytes(),
            "cpu_s": cpu_timed,
            "phases_s": {
                "setup": round(t_setup - t_start, 2),
                "train": round(t_train - t_setup, 2),
                "accounting": round(time.monotonic() - t_train, 2),
            },
        },
    )
    wait_exit_then_close([client], server)


# ----------------------------------------------------------------------------- torch
def torch_main(a: argparse.Namespace) -> None:
    t_start = time.monotonic()
    child_guard(a.lifetime)
    import torch

    from examples.gpt import Block, lm_loss

    W = a.world
    single = a.strategy == "single"
    set_threads(1 if single else W)
    if not single:
        init_gloo(a.port, a.rank, W)
    gpt = build_gpt(a.model)
    n_params = gpt.num_params()

    if single:
        model, opt = gpt, adamw(gpt.parameters())
    elif a.strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(gpt, forward_sync_buffers=False)  # the mask buffer is a constant
        if a.strategy == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                model.parameters(),
                optimizer_class=torch.optim.AdamW,
                **ADAMW,
            )
        else:
            opt = adamw(model.parameters())
    elif a.strategy in ("fsdp2", "fsdp2_zero2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (W,))
        raf = a.strategy == "fsdp2"
        for m in gpt.modules():
            if isinstance(m, Block):
                fully_shard(m, mesh=mesh, reshard_after_forward=raf)
        fully_shard(gpt, mesh=mesh, reshard_after_forward=raf)
        model, opt = gpt, adamw(gpt.parameters())
    else:
        raise ValueError(a.strategy)

    per = MODELS[a.model]["batch_per_rank"] * (W if single else 1)
    rank = 0 if single else a.rank
    batches = make_batches(a.model, W, a.steps + 1)
    t_setup, cpu0 = time.monotonic(), cpu_self_s()
    times, losses, phases = timed_steps(model, opt, lm_loss, batches[:-1], rank, per)
    t_train, cpu_timed = time.monotonic(), cpu_self_s() - cpu0
    # accounting step: gradients are held until the next zero_grad
    timed_steps(model, opt, lm_loss, batches[-1:], rank, per)
    ps = list(model.parameters())
    mem = {
        "param_bytes": sum(tensor_bytes(p) for p in ps),
        "grad_bytes": sum(tensor_bytes(p.grad) for p in ps if p.grad is not None),
        "optimizer_bytes": optimizer_state_bytes(opt),
    }
    emit(
        "RESULT",
        {
            "rank": a.rank,
            "n_params": n_params,
            "times_s": times,
            "phases": phases,
            "losses": losses,
            "trainer": mem,
            "peak_rss_bytes": peak_rss_bytes(),
            "cpu_s": cpu_timed,
            "phases_s": {
                "setup": round(t_setup - t_start, 2),
                "train": round(t_train - t_setup, 2),
                "accounting": round(time.monotonic() - t_train, 2),
            },
        },
    )
    if not single:
        end_gloo()


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


SERVE_SHIM = (
    "import ctypes,os,signal,sys;"
    "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM);"  # die with the benchmark
    "os.getppid()==int(sys.argv[1]) or sys.exit(3);"
    "from paramshard.cli import main;"
    "sys.exit(main(['serve','--port','0','--grace','0']))"
)


def start_servers(world: int, timeout: float) -> tuple[list[Child], list[str]]:
    """``python -m paramshard serve --port 0`` x W (via a shim that only adds a parent-death
    signal), with MALLOC_ENV set; returns them and their addresses."""
    env = child_env(tuned=True)
    cmd = [sys.executable, "-c", SERVE_SHIM, str(os.getpid())]
    servers = [Child(f"server{i}", cmd, env, terminate_on_stop=True) for i in range(world)]
    addresses = []
    for s in servers:
        text = s.expect("listening on ", timeout, watch=servers, anywhere=True)
        addresses.append(text.split()[0])
    return servers, addresses


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
        servers, addresses = start_servers(world, STARTUP_S)
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
