"""A server's optimizer step against torch's on the same elements, one thread each.

    python -m benchmarks.optimizer_step [--quick] [--numel 31000000,62000000] [--steps 5]

For each size: a server's ``AdamW`` (``paramshard.server.optimizers``, NumPy: how a shard
server steps its slice, torch's single-tensor CPU rules term by term, each fused multiply-add
emulated in float64 so the result is torch's bit for bit) against ``torch.optim.AdamW`` on
one tensor of the same elements:

- ``torch_single``: ``foreach=False``, the single-tensor loop (torch's default for CPU
  tensors, and what the scale benchmark's torch ranks and compute alone run);
- ``torch_fused``: ``fused=True``, one vectorised kernel for every term (not the same
  rounding: it is reported for its pace, not compared bit for bit).

The hyper-parameters are the scale benchmark's (``_scale_models.ADAMW``). Every side starts
from the same parameters and takes the same gradients. Reported per size: the median
seconds a step over ``--steps`` after one warm-up step, nanoseconds an element, ours / each
torch path, and the largest difference between ours' parameters and the single-tensor
path's after the steps (0.0: bitwise equal).

Why it matters: ZeRO and FSDP step on the servers, so the servers' AdamW is part of those
strategies' step. At GPT-2 124M, W = 4, the scale benchmark's slowest server stepped its 31M
elements in 0.37-0.93 s of wall time over six runs (``server_step``, four servers on two
cores; docs/benchmarks.md).

JSON to stdout, progress to stderr. One process; ``--quick``: 1M elements, 3 steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from benchmarks._processes import logger
from benchmarks._scale_memory import machine
from benchmarks._scale_models import ADAMW, SEED

log = logger("optimizer_step")


def _timed(step: Any, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step`` after one warm-up call."""
    step()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def measure(numel: int, steps: int) -> dict[str, Any]:
    """One size: ours and torch's two paths, ``steps`` timed steps each (see the docstring)."""
    import torch

    from paramshard.server.optimizers import adam
    from paramshard.strategies.data_parallel.server_optim import server_hyper

    rng = np.random.default_rng(SEED)
    start = rng.standard_normal(numel, dtype=np.float32)
    grad = rng.standard_normal(numel, dtype=np.float32) * np.float32(1e-2)

    ours_param = start.copy()
    ours = adam.AdamW(numel, server_hyper("adamw", ADAMW))  # as a strategy hands them over
    times = {"ours": _timed(lambda: ours.step(ours_param, grad), steps)}
    params = {}
    for name, kwargs in (("torch_single", {"foreach": False}), ("torch_fused", {"fused": True})):
        p = torch.nn.Parameter(torch.from_numpy(start.copy()))
        p.grad = torch.from_numpy(grad)  # shared, read only: every side steps the same
        opt = torch.optim.AdamW([p], **ADAMW, **kwargs)
        with torch.no_grad():
            times[name] = _timed(opt.step, steps)
        params[name] = p.detach().numpy()
        del opt
    out: dict[str, Any] = {"numel": numel}
    for name, ts in times.items():
        median = statistics.median(ts)
        out[f"{name}_s"] = round(median, 4)
        out[f"{name}_ns_per_element"] = round(median / numel * 1e9, 2)
    for name in ("torch_single", "torch_fused"):
        out[f"ours_vs_{name}"] = round(out["ours_s"] / out[f"{name}_s"], 3)
    out["max_abs_diff_vs_single"] = float(np.max(np.abs(ours_param - params["torch_single"])))
    log(
        f"{numel:,} elements: ours {out['ours_ns_per_element']} ns/element,"
        f" torch single {out['torch_single_ns_per_element']}, fused"
        f" {out['torch_fused_ns_per_element']}; max diff {out['max_abs_diff_vs_single']}"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="1M elements, 3 steps")
    p.add_argument("--numel", default="31000000,62000000", help="elements, comma-separated")
    p.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up")
    a = p.parse_args(argv)
    sizes = [1_000_000] if a.quick else [int(x) for x in a.numel.split(",") if x.strip()]
    steps = 3 if a.quick else a.steps
    if not sizes or min(sizes) < 1 or steps < 1:
        raise SystemExit("--numel takes positive counts and --steps at least 1")
    import torch

    torch.set_num_threads(1)  # one intra-op thread, as the scale benchmark's ranks
    out = {
        "benchmark": "optimizer_step",
        "command": " ".join(sys.argv),
        "machine": machine(),
        "optimizer": "AdamW",
        "hyper": ADAMW,
        "results": [measure(n, steps) for n in sizes],
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
