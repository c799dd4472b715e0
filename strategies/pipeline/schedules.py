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

- Interleaved 1F1B (Megatron-LM arXiv 2104.04473 §2.2.2): each rank holds ``v`` model chunks
  (virtual stages ``rank, rank + p, ...`` of ``p * v``) and runs 1F1B over (chunk,
  micro-batch) pairs, micro-batches in groups of ``p`` per chunk. Each chunk is 1/v of a
  stage, so the bubble shrinks by ``v``; activations cross ranks ``v`` times as often.

GPipe and 1F1B have the bubble fraction ``(p - 1) / (m + p - 1)`` of the schedule's wall time
(idle time over total, with equal forward/backward cost per stage); the papers quote it as
``(p - 1) / m`` of the ideal compute time, and ``(p - 1) / (v m)`` interleaved.

GPipe's and 1F1B's steps are ``(kind, micro-batch)``; interleaved steps carry the chunk too,
``(kind, micro-batch, chunk)``.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "Step",
    "ScheduleName",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "interleaved_schedule",
    "build_schedule",
    "schedule_name",
    "peak_live_activations",
    "theoretical_bubble_fraction",
]

Step = tuple[Literal["F", "B"], int]
ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b"]
ChunkStep = tuple[Literal["F", "B"], int, int]
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


def interleaved_schedule(
    num_stages: int, stage: int, num_microbatches: int, num_chunks: int
) -> list[ChunkStep]:
    """Interleaved 1F1B for rank ``stage`` holding ``num_chunks`` chunks.

    The k-th forward of a rank is micro-batch ``(k // (p v)) p + k % p`` of chunk
    ``(k % (p v)) // p``: groups of ``p`` micro-batches go through chunk 0, then chunk 1, ...
    The k-th backward takes the same micro-batch with the chunks in reverse. Rank ``s`` warms
    up with ``2 (p - s - 1) + (v - 1) p`` forwards (all of them when ``m == p``), then
    alternates one forward and one backward, then drains the backwards. Every rank runs the
    forwards (and the backwards) in the same (chunk, micro-batch) order, so each pair of ranks
    exchanges activations, and gradients, in the order they were sent.
    """
    _check(num_stages, stage, num_microbatches)
    p, m, v = num_stages, num_microbatches, num_chunks
    if v < 1:
        raise ValueError(f"the interleaved schedule needs >= 1 chunks per rank, got {v}")
    if m % p:
        raise ValueError(
            f"the interleaved schedule needs micro_batch_count ({m}) divisible by the number"
            f" of pipeline stages ({p})"
        )
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        in_group = k % (p * v)
        chunk = in_group // p
        return (k // (p * v)) * p + in_group % p, chunk if forward else v - 1 - chunk

    warmup = total if m == p else min(2 * (p - stage - 1) + (v - 1) * p, total)
    steps: list[ChunkStep] = [("F", *unit(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        steps.append(("F", *unit(warmup + k, True)))
        steps.append(("B", *unit(k, False)))
    steps += [("B", *unit(k, False)) for k in range(total - warmup, total)]
    return steps


_ALIASES = {"interleaved": "interleaved_1f1b", "pipedream_flush": "1f1b"}


def schedule_name(name: str) -> ScheduleName:
    """The canonical name of a schedule: case, '-' for '_' and "interleaved" accepted."""
    key = str(name).lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    return key  # type: ignore[return-value]


def build_schedule(
    name: ScheduleName, num_stages: int, stage: int, num_microbatches: int, num_chunks: int = 1
) -> list[ChunkStep]:
    """The steps of schedule ``name`` for one rank, as ``(kind, micro-batch, chunk)``; the
    chunk is 0 but for "interleaved_1f1b" (``num_chunks`` chunks per rank)."""
    name = schedule_name(name)
    if name == "interleaved_1f1b":
        return interleaved_schedule(num_stages, stage, num_microbatches, num_chunks)
    if num_chunks != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank, got {num_chunks}")
    if name == "gpipe":
        steps = gpipe_schedule(num_stages, stage, num_microbatches)
    elif name == "1f1b":
        steps = one_f_one_b_schedule(num_stages, stage, num_microbatches)
    else:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    return [(kind, i, 0) for kind, i in steps]


def peak_live_activations(steps: list[Step] | list[ChunkStep]) -> int:
    """Most (chunk, micro-batch)es whose forward ran and backward did not yet, at any point."""
    live = peak = 0
    for kind, *_ in steps:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def theoretical_bubble_fraction(
    num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> float:
    """Idle share of a step's wall time: (p - 1) / (m + p - 1) for GPipe and 1F1B, and
    (p - 1) / (v m + p - 1) interleaved with v chunks per rank."""
    return (num_stages - 1) / (num_chunks * num_microbatches + num_stages - 1)
