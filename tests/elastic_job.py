"""One rank of an elastic float64 FSDP job, as a script, and the single-process run it must equal.

    python tests/elastic_job.py STEPS OUT [--die RANK:STEP[:LIFE[:after]] ...]

Run by ``paramshard launch --elastic`` (tests/test_elastic_launch.py) or started by hand with
RANK, WORLD_SIZE and PARAMSHARD_* set (the chaos test). Each step's global batch is a function
of the step, each rank trains its ``model.batch_part`` of it through ``train_with_recovery``
(AdamW, clipping at 1.0, an LR schedule by the global step). ``--die R:S[:L[:after]]`` makes
rank R SIGKILL itself in step S of its life L (default 0: its first process; ``LIFE`` in the
environment counts lives a launcher does not, torchrun's ``TORCHELASTIC_RESTART_COUNT`` the
group's restarts), before its backward, or after it with
``after`` (its gradients are then on the servers). Every rank that
finishes writes its final parameters to OUT.rank<R>.pt, and the lowest finishing rank the
coordinator's membership record to OUT.membership.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch

BATCH, LR = 12, 1e-2


def net() -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(), torch.nn.Linear(32, 3)
    ).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same whoever trains it."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 8, generator=gen, dtype=torch.float64)
    return x, torch.randn(BATCH, 3, generator=gen, dtype=torch.float64)


def schedule(step: int) -> float:
    return 1.0 / (1 + 0.5 * step)


def single_process(steps: int) -> dict[str, torch.Tensor]:
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for s in range(steps):
        x, y = batch(s)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
    return model.state_dict()


def main(argv: list[str]) -> int:
    from paramshard.client import restarts
    from paramshard.protos.atomic import atomic_write
    from paramshard.strategies import (
        FSDPModel,
        FSDPOptimizer,
        ShardingConfiguration,
        train_with_recovery,
    )

    p = argparse.ArgumentParser()
    p.add_argument("steps", type=int)
    p.add_argument("out")
    p.add_argument("--die", action="append", default=[])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config = ShardingConfiguration.from_env(job="elastic", timeout_s=120.0, join_window_s=30.0)
    lives = (os.environ.get(name, "0") for name in ("LIFE", "TORCHELASTIC_RESTART_COUNT"))
    rank, life = config.rank, restarts.restart_count() + sum(map(int, lives))
    deaths = {}
    for spec in args.die:
        r, s, lf, when = (spec.split(":") + ["0", "before"])[:4]
        deaths[(int(r), int(lf))] = (int(s), when == "after")
    die_at, after = deaths.get((rank, life), (None, False))
    model = FSDPModel(net(), config, wrap=(torch.nn.Linear,))
    opt = FSDPOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), config)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    print(f"START {model.step_count} life {life} at {time.time():.3f}", flush=True)

    def train_step(s: int) -> float:
        x, y = batch(s)
        part = model.batch_part(BATCH)
        if s == die_at and not after:
            print(f"KILL at step {s}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.mse_loss(model(x[part]), y[part])
        loss.backward()
        if s == die_at:
            model.synchronize_gradients()  # its gradients are on the servers
            print(f"KILL at step {s}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    report = train_with_recovery(model, train_step, args.steps, checkpoint_every=0, scheduler=sched)
    # at once whole or not at all: the chaos test may kill a rank as it writes (a SIGKILL in
    # torch.save left a truncated file that the test then read: EOFError)
    with atomic_write(f"{args.out}.rank{rank}.pt") as f:
        torch.save(model.state_dict(), f)
    members = model.client.status()[0].get("memberships", [])
    joined = model.joined  # None: it came as the job ended and trained no step
    if joined is not None and rank == joined.leader:
        with open(f"{args.out}.membership.json", "w", encoding="utf-8") as f:
            json.dump(members, f)
    print(f"DONE recoveries {report.recoveries} steps {sorted(report.losses)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
