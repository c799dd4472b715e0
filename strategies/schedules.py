"""Pipeline schedules as plain step lists: what one stage does, in order.

A schedule is a list of ``("F", i)`` (forward of micro-batch ``i``) and ``("B", i)`` (its
backward). The stage executes the list top to bottom; sends never block (they land in the
receiver's server mailbox), so any schedule in which every stage sends and receives each
neighbour's tensors in the same micro-batch order runs without deadlock.

- GPipe (Huang et al., arXiv 1811.06965): all ``m`` forwards, then all backwards. Simple, but
  every stage keeps ``m`` micro-batches of activations alive.
- 1F1B (PipeDream-Flush, Narayanan et al., arXiv 2006.09503 §2; Megatron-LM arXiv 2104.04473
  §2.2.1): ``pp - stage - 1`` warm-up forwards, then alternate one forward and one backward,
  then the remaining backwards. Same bubble as GPipe, but at most ``pp - stage`` micro-batches
  of activations alive on a stage.

Both have the bubble fraction ``(p - 1) / (m + p - 1)`` of the schedule's wall time (idle time
over total, with equal forward/backward cost per stage); the papers quote it as ``(p - 1) / m``
of the ideal compute time.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "Step",
    "ScheduleName",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "build_schedule",
    "peak_live_activations",
    "theoretical_bubble_fraction",
]

Step = tuple[Literal["F", "B"], int]
ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = get_args(ScheduleName)


def _check(num_stages: int, stage: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside stages 0..{num_stages - 1}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def gpipe_schedule(num_stages: int, stage: int, num_microbatches: int) -> list[Step]:
    """GPipe: F0 .. F(m-1), then B0 .. B(m-1) (the same on every stage)."""
    _check(num_stages, stage, num_microbatches)
    m = num_microbatches
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_schedule(num_stages: int, stage: int, num_microbatches: int) -> list[Step]:
    """1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    Stage ``s`` of ``p`` first runs ``min(p - s - 1, m)`` forwards so that the last stage can
    start its first backward as soon as its first forward is done; from then on each forward
    is followed by the oldest pending backward, which frees that micro-batch's activations.
    """
    _check(num_stages, stage, num_microbatches)
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    steps: list[Step] = [("F", i) for i in range(warmup)]
    next_backward = 0
    for i in range(warmup, m):
        steps.append(("F", i))
        steps.append(("B", next_backward))
        next_backward += 1
    steps += [("B", i) for i in range(next_backward, m)]
    return steps


def build_schedule(
    name: ScheduleName, num_stages: int, stage: int, num_microbatches: int
) -> list[Step]:
    """The steps of schedule ``name`` ("gpipe" or "1f1b") for one stage."""
    if name == "gpipe":
        return gpipe_schedule(num_stages, stage, num_microbatches)
    if name == "1f1b":
        return one_f_one_b_schedule(num_stages, stage, num_microbatches)
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")


def peak_live_activations(steps: list[Step]) -> int:
    """Most micro-batches whose forward ran and backward did not yet, at any point."""
    live = peak = 0
    for kind, _ in steps:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def theoretical_bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle share of a GPipe / 1F1B step's wall time: (p - 1) / (m + p - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
