"""What rank 0 of examples/train_gpt.py shows: a progress bar while it trains, and the summary
of the run at the end (steps, speed, recoveries, losses, the sample, the checks)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["progress_bar", "summarize"]


def progress_bar(args: argparse.Namespace, start: int, enabled: bool) -> Any:
    """tqdm on rank 0: redrawn in place on a terminal; else one line every --log-every steps
    ("step   10/60  loss=..."), which launchers and log files keep readable."""
    from tqdm import tqdm

    if sys.stderr.isatty():
        return tqdm(total=args.steps, initial=start, disable=not enabled, unit="step")

    class Lines:  # tqdm redraws with "\r"; each redraw becomes one line
        def write(self, text: str) -> None:
            if text.strip("\r\n "):
                print(text.strip("\r\n "), flush=True)

        def flush(self) -> None:
            sys.stdout.flush()

    return tqdm(
        total=args.steps, initial=start, disable=not enabled, file=Lines(), ncols=80,
        miniters=args.log_every, mininterval=0, maxinterval=float("inf"), leave=False,
        unit="step", bar_format="step {n:4d}/{total}{postfix}  [{elapsed}<{remaining}, {rate_fmt}]",
    )  # fmt: skip


def summarize(
    args: argparse.Namespace,
    report: Any,
    start: int,
    end: int,
    elapsed: float,
    comm: float,
    val_losses: dict[int, float],
    sample: Callable[[], str],
) -> int:
    """Prints the run's summary and a sample; returns the exit code: 1 when the validation loss
    missed ``--target-loss`` or the training loss did not go down."""
    losses = [report.losses[s] for s in sorted(report.losses)]
    # a step whose update the servers committed before this rank's step failed has no loss
    steps = report.trained_steps
    if not losses:
        print(f"done: the servers were at step {start} already", flush=True)
        return 0
    print(
        f"done: {len(steps)} steps in {elapsed:.1f} s,"
        f" {len(steps) * args.batch_size * args.block_size / elapsed:.0f} tok/s,"
        f" {100 * comm / elapsed:.0f}% of the time in communication",
        flush=True,
    )
    if steps == list(range(start, end)):
        kind = "continuous"
    elif args.elastic and steps == list(range(steps[0], end)):  # it sat out steps as it came
        kind = f"continuous from step {steps[0] + 1}, where this rank joined"
    else:
        kind = "NOT continuous"
    print(
        f"steps {steps[0] + 1}..{steps[-1] + 1} trained ({kind}), the"
        f" servers at version {end}; {report.recoveries} recoveries"
        + "".join(f", resumed at step {r + 1}" for r in report.resumed_at)
        + f"; {report.replayed_steps} steps replayed"
        + "".join(
            f"; step {s + 1} committed before its failure, its loss unknown"
            for s in report.committed_without_loss
        ),
        flush=True,
    )
    k = min(5, len(losses))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"first loss {first:.4f} -> last loss {last:.4f} (mean of {k} steps each)", flush=True)
    print(f"sample: {sample()!r}", flush=True)
    if args.target_loss is not None:
        val = val_losses[max(val_losses)] if val_losses else float("nan")
        if not val < args.target_loss:
            print(f"FAILED: validation loss {val:.4f} not below {args.target_loss}", flush=True)
            return 1
        print(f"OK: validation loss {val:.4f} < {args.target_loss} at step {end}", flush=True)
    if len(losses) < 2 * k:  # a short run (--steps 5), or resumed near its end
        at = f"resumed at step {start}; " if start else ""
        print(f"OK: {at}{len(losses)} steps are too few to judge the loss", flush=True)
        return 0
    if not last < first:
        print("FAILED: the loss did not go down", flush=True)
        return 1
    print("OK: the loss went down", flush=True)
    return 0
