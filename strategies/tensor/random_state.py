"""Tensor ranks draw the same random numbers, or training says so.

The ranks of a tensor-parallel group compute one model on one batch: its replicated parts
(embeddings, layer norms, the residual stream) must stay equal on every rank. Dropout there
draws from each rank's own generator, so ranks seeded apart (``torch.manual_seed(1000 +
rank)``, a habit from data parallelism) drop different units: the group's ranks then report
different losses for one step and their replicated weights drift apart (5.3e-3 after three
steps of a GPT-2 with its default dropout of 0.1, in a walkthrough), while ``state_dict()``
exports tensor rank 0's copy. torch's DTensor and Megatron-LM keep one generator state for a
group's replicated parts; here the script seeds every rank of a group alike, and
``same_draws`` checks it.

``same_draws(tp, what)`` wraps a training forward: for each generator (the CPU's, the CUDA
device's) that moved during it (the forward drew random numbers), the group compares the
states it started from on the ranks where it moved, in one all-gather over the group made on
every rank of it (so none waits alone); a generator that drew nothing is not compared, so a
forward that draws nothing, with ranks seeded apart, is fine and costs that one all-gather.
Ranks that are threads of one process (``LocalCluster``) share torch's generators, so one
rank's draws move the others' and nothing can be compared: the all-gather tells them apart
(each process's own random number), and such a group is not checked.
"""

from __future__ import annotations

import secrets
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["same_draws"]

_PROCESS = float(secrets.randbits(52))  # this process among the group's, exact in a float64


def _fingerprints() -> tuple[int, int]:
    """31-bit checksums of this process's generator states: the CPU's, and the current CUDA
    device's once CUDA is in use (0 before: a rank that never used CUDA draws nothing there)."""
    cpu = zlib.crc32(torch.random.get_rng_state().numpy().tobytes())
    cuda = 0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = zlib.crc32(torch.cuda.get_rng_state().numpy().tobytes())
    return cpu & 0x7FFFFFFF, cuda & 0x7FFFFFFF


@contextmanager
def same_draws(tp: Any, what: str) -> Iterator[None]:
    """Runs the body (a training forward of tensor group ``tp``), then raises RuntimeError
    when ranks of the group drew random numbers from different generator states."""
    if tp.world_size <= 1:
        yield
        return
    before = _fingerprints()
    yield
    after = _fingerprints()
    row = [_PROCESS]
    for b, a in zip(before, after, strict=True):  # each generator: did it move, from where
        row += [float(b not in (a, 0)), float(b)]  # CUDA's first use: nothing to compare
    rows = tp.all_gather(torch.tensor(row, dtype=torch.float64))
    threads = len({float(r[0]) for r in rows}) < len(rows)  # their generators are one
    apart = any(
        len({int(r[i + 1]) for r in rows if r[i]}) > 1 for i in (1, 3)
    )  # a generator that drew on several ranks, from different states
    if apart and not threads:
        raise RuntimeError(
            f"{what}: the ranks of a tensor-parallel group drew random numbers (dropout) from"
            " different generator states, so their replicated weights would drift apart and"
            " their losses differ. Seed every rank of a tensor group alike before training"
            " (torch.manual_seed(seed), the same seed on each, as torch's DTensor and Megatron-LM"
            " keep one generator state for a group's replicated parts); data-parallel replicas"
            " may be seeded apart"
        )
