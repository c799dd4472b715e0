"""What the training benchmarks (``benchmarks.strategies``, ``benchmarks.hybrid``) share.

- the GPTs (tiny 867,072, small 13,842,432 and gpt2, GPT-2 124M's shape, 162,349,056
  parameters; all untied), the AdamW settings and the batches: fixed random tokens, seeded
  per step, W x per-rank sequences;
- starting one cell's rank processes (``launch_ranks``): ours, each rank hosting a
  ``ShardServer`` whose address the ranks exchange through the parent (``hosted_server``), or
  torch's gloo ranks (``init_gloo``), measured with the share of CPU others used meanwhile;
- the summaries: the slowest rank's median step time, losses against single-process training.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks._cpu import Load, wait_quiet
from benchmarks._processes import Child, child_env, emit, expect_all, read_line, run_child, stop_all

MODELS: dict[str, dict[str, Any]] = {
    "tiny": {
        "preset": "tiny",
        "overrides": dict(
            vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128, tie_weights=False
        ),
        "batch_per_rank": 8,
        "steps": 20,
        "warmup": 5,
        "step_budget_s": 10.0,
    },
    "small": {
        "preset": "small",
        "overrides": dict(
            vocab_size=4096, block_size=128, n_layer=6, n_head=6, n_embd=384, tie_weights=False
        ),
        "batch_per_rank": 4,
        "steps": 9,
        "warmup": 3,
        "step_budget_s": 40.0,
    },
    "gpt2": {  # GPT-2 124M's shape; untied (torch's pipelining splits no tied weight)
        "preset": "small",
        "overrides": dict(
            vocab_size=50257, block_size=128, n_layer=12, n_head=12, n_embd=768, tie_weights=False
        ),
        "batch_per_rank": 2,
        "steps": 6,
        "warmup": 2,
        "step_budget_s": 120.0,
    },
}
LR, BETAS, EPS, WD, SEED = 1e-3, (0.9, 0.95), 1e-8, 0.01, 1234
ADAMW = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
STARTUP_S = 120.0  # bound on starting a cell's processes (imports, servers, process group)


# ================================================================================ model, data
def build_gpt(model: str):
    import torch

    from paramshard.models.gpt import GPT, GPTConfig

    spec = MODELS[model]
    cfg = getattr(GPTConfig, spec["preset"])(**spec["overrides"])
    torch.manual_seed(SEED)
    return GPT(cfg)


def adamw(params: Any):
    import torch

    return torch.optim.AdamW(params, **ADAMW)


def make_batches(model: str, world: int, steps: int):
    """``steps`` fixed random (x, y) global batches of W x per-rank sequences."""
    import torch

    spec = MODELS[model]
    B = world * spec["batch_per_rank"]
    T = spec["overrides"]["block_size"]
    V = spec["overrides"]["vocab_size"]
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(SEED * 1000 + s)
        seq = torch.randint(0, V, (B, T + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def model_info(model: str, steps: int, warmup: int) -> dict[str, Any]:
    spec = MODELS[model]
    return {
        "config": f"GPTConfig.{spec['preset']}(**{spec['overrides']})",
        "n_params": build_gpt(model).num_params(),
        "batch_per_rank": spec["batch_per_rank"],
        "seq_len": spec["overrides"]["block_size"],
        "steps": steps,
        "warmup": warmup,
    }


def models_and_worlds(a: Any, quick_worlds: list[int]) -> tuple[list[str], list[int]]:
    """``--models`` and ``--world-sizes`` (``--quick``: tiny at ``quick_worlds``), checked."""
    if a.quick:
        return ["tiny"], quick_worlds
    models = parse_list(a.models)
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    return models, parse_list(a.world_sizes, int)


def steps_and_warmup(
    a: Any, models: list[str], quick_steps: int, quick_warmup: int
) -> tuple[dict[str, int], dict[str, int]]:
    """Per model: steps per run (warm-up included) and warm-up steps, from ``--steps`` /
    ``--warmup``, else ``--quick``'s or the model's defaults."""
    steps = {m: a.steps or (quick_steps if a.quick else MODELS[m]["steps"]) for m in models}
    warm = {
        m: a.warmup if a.warmup is not None else (quick_warmup if a.quick else MODELS[m]["warmup"])
        for m in models
    }
    for m in models:
        if warm[m] >= steps[m]:
            raise SystemExit(f"--steps ({steps[m]}) must exceed --warmup ({warm[m]})")
    return steps, warm


# ================================================================================ rank side
def hosted_server() -> tuple[Any, list[str]]:
    """Starts this rank's in-process ShardServer, tells the parent its address and returns
    it with every rank's server address (in rank order, from the parent)."""
    from paramshard.server import ShardServer

    server = ShardServer("127.0.0.1", 0).start()
    emit("ADDR", server.address)
    return server, read_line("SERVERS ", STARTUP_S).split(",")


def wait_exit() -> None:
    """Others may still pull from our server: stay until the parent says every rank is done."""
    read_line("EXIT", 120.0)


def close_rank(clients: list[Any], server: Any) -> None:
    """Closes this rank's clients, then stops its server (if it hosts one). On every way out of
    a rank, a failed one's included: a server left running at exit hangs the process
    (protos/closing.py says how)."""
    for c in clients:
        c.close()
    if server is not None:
        server.stop(0)


GLOO_ADDR_ENV = "PARAMSHARD_BENCH_GLOO_ADDR"
"""Where rank 0's gloo store listens (default 127.0.0.1; the lab's ranks: host 0's address)."""


def init_gloo(port: int, rank: int, world: int) -> None:
    import datetime

    import torch.distributed as dist

    host = os.environ.get(GLOO_ADDR_ENV, "127.0.0.1")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )


def end_gloo() -> None:
    """Leave the process group together (no rank exits while another still sends)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def set_threads(world: int) -> None:
    """Each of W processes on this machine gets cores // W torch threads (torch's ranks too)."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


# ================================================================================ parent side
def launch_ranks(
    module: str,
    mode: str,
    label: str,
    world: int,
    argv: list[str],
    budget: float,
    *,
    tuned: bool,
    hosted_servers: bool,
    send_exit: bool = False,
    log: Callable[[str], None] | None = None,
    watch: list[Child] = (),  # type: ignore[assignment]
) -> list[dict[str, Any]]:
    """Starts ``world`` processes ``python -m module mode *argv --rank r --lifetime L``,
    returns their RESULT payloads in rank order, within ``budget`` seconds.

    ``hosted_servers``: each rank hosts a server; the parent collects their ADDR lines and
    sends every rank the list (SERVERS), and after every RESULT tells them to EXIT (so no rank
    stops its server while another still needs it; ``send_exit``: EXIT without hosted
    servers). ``watch``: other children (e.g. server
    processes) whose death fails the cell. The ranks are stopped by PID before returning."""
    deadline = time.monotonic() + budget
    env = child_env(tuned)
    ranks: list[Child] = []

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    try:
        for r in range(world):
            ranks.append(
                Child.module(
                    f"{label}-r{r}", module, [mode, *argv, "--rank", str(r)], env, budget + 60
                )
            )
        everyone = [*ranks, *watch]
        if hosted_servers:
            addresses = expect_all(ranks, "ADDR", left(), watch=everyone)
            for k in ranks:
                k.send("SERVERS " + ",".join(addresses))
        results = [json.loads(x) for x in expect_all(ranks, "RESULT", left(), watch=everyone)]
        t_done = time.monotonic()
        if hosted_servers or send_exit:
            for k in ranks:
                k.send("EXIT")
        for k in ranks:
            k.proc.wait(timeout=max(5.0, left()))
        if log is not None:
            ph = results[0].get("phases_s", {})  # where the rank reports its phases
            said = [f"{k} {ph[k]} s" for k in ("setup", "train") if k in ph]
            log(f"    rank 0: {', '.join([*said, f'exit {time.monotonic() - t_done:.1f} s'])}")
        return results
    finally:
        stop_all(ranks)


def attempt_cell(label: str, log: Callable[[str], None], fn: Callable[[], Any]) -> tuple:
    """(``fn()``, None), or (None, the error) when it fails: one failed cell must not end the
    run."""
    t0 = time.monotonic()
    try:
        res = fn()
        log(f"  {label}: done in {time.monotonic() - t0:.0f} s")
        return res, None
    except Exception as exc:  # noqa: BLE001 - reported in the cell's row
        log(f"  {label}: FAILED: {exc}")
        return None, f"{type(exc).__name__}: {exc}"


def measured(wait: float, log: Callable[[str], None], fn: Callable[[], Any]) -> Any:
    """``fn()`` (a list of per-rank result dicts) after waiting up to ``wait`` s for a
    quiet machine; each result gets ``foreign_cpu_frac``, the share of the CPUs that other
    processes used meanwhile, and ``steal_frac``, the steal within it (``Load``)."""
    if wait > 0:
        wait_quiet(
            wait,
            busy=lambda f: log(f"    machine still busy ({100 * f:.0f}% of CPUs used or stolen)"),
        )
    with Load() as load:
        results = fn()
    for r in results:
        r["foreign_cpu_frac"], r["steal_frac"] = load.foreign, load.steal
    return results


def median_ms(results: list[dict[str, Any]], warmup: int, key: str = "times_s") -> tuple:
    """(median over the steps after ``warmup`` of the slowest rank's step ms, every step's)."""
    times = [r[key] for r in results]
    per_step = [max(t[i] for t in times) for i in range(len(times[0]))]
    timed = per_step[warmup:] or per_step
    return round(statistics.median(timed) * 1e3, 2), [round(t * 1e3, 1) for t in per_step]


def mean_losses(results: list[dict[str, Any]]) -> list[float]:
    """Per step, the mean over the ranks that report a loss (``None``: this rank has none)."""
    out = []
    for i in range(len(results[0]["losses"])):
        vals = [r["losses"][i] for r in results if r["losses"][i] is not None]
        out.append(sum(vals) / len(vals))
    return out


def max_rel_diff(a: list[float], b: list[float] | None) -> float | None:
    if not b:
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=False))


def parse_list(text: str, kind: type = str) -> list[Any]:
    return [kind(x) for x in text.replace(" ", "").split(",") if x]


def print_report(out: dict[str, Any]) -> int:
    """Prints the JSON document; 1 when a row has an error."""
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    sys.stdout.flush()
    failed = [r for r in out.get("results", []) if r.get("error")]
    return 1 if failed else 0


def run_main(
    argv: list[str] | None,
    doc: str | None,
    ranks: dict[str, Callable[[argparse.Namespace], None]],
    rank_options: tuple[list[str], list[str]],
    quick: str,
    models: str,
    world_sizes: str,
    add_options: Callable[[argparse.ArgumentParser], None],
    parent: Callable[[argparse.Namespace], int],
) -> int:
    """A training benchmark's command line: ``_mode`` runs one rank (``ranks[mode]``, with the
    string and int options of ``rank_options`` plus --world, --rank, --steps, --port and
    --lifetime); anything else is the parent: --quick (help ``quick``), --models,
    --world-sizes (defaults given), --steps, --warmup, --wait-quiet and ``add_options``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ranks:
        p = argparse.ArgumentParser()
        for k in ("--model", *rank_options[0]):
            p.add_argument(k, default="")
        for k in ("--world", "--rank", "--steps", "--port", *rank_options[1]):
            p.add_argument(k, type=int, default=0)
        p.add_argument("--lifetime", type=float, default=600.0)
        rank_args = p.parse_args(argv[1:])
        run_child(lambda: ranks[argv[0]](rank_args))
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    per_model = ", ".join(f"{m} {MODELS[m]['steps']}" for m in MODELS)
    warm = ", ".join(f"{m} {MODELS[m]['warmup']}" for m in MODELS)
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument(
        "--models",
        default=models,
        help=f"comma-separated, of {', '.join(MODELS)} (default: %(default)s)",
    )
    p.add_argument("--world-sizes", default=world_sizes, help="default: %(default)s")
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help=f"steps per run, warm-up included (default: {per_model})",
    )
    p.add_argument(
        "--warmup", type=int, default=None, help=f"steps left out of the median (default: {warm})"
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="before each run, wait up to this many seconds for other processes to"
        " leave the CPUs idle and the hypervisor to steal little (default: 0, don't wait)",
    )
    add_options(p)
    return parent(p.parse_args(argv))
