"""Tensor-parallel communication: Megatron's ``f`` and ``g``, and the gather/scatter pair.

After Megatron-LM (Shoeybi et al., arXiv 1909.08053, §3) and picotron's
``tp_communications.py``. Each is an autograd function whose backward is the forward's
transpose, so a column-parallel layer followed by a row-parallel one costs one all-reduce
forward (``g``) and one backward (``f``). Every collective goes through the group's
``ShardClient`` (one RPC round trip to the servers); on a group of one each is the identity.

A part of the last dim is described by ``ranges``: for every rank, the ranges of the whole
dim it holds, in order (``layers.part_ranges``; one range, or one per packed block). Without
them the dim is cut into equal parts in rank order.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from paramshard.strategies.device import claim_backward_device

__all__ = [
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "gather_from_tensor_parallel",
    "scatter_to_tensor_parallel",
]

Ranges = Sequence[Sequence[range]]  # rank -> the ranges of the whole dim it holds
# group client -> (input, its version, output) of its last ``f`` (see copy_to_tensor_parallel)
_LAST_F: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _CopyToTensorParallel(torch.autograd.Function):
    """The ``f`` function in the paper (arXiv 1909.08053, §3): identity forward, all-reduce
    of the input gradient backward (each rank holds only its part's contribution to it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, client: Any) -> torch.Tensor:
        ctx.client = client
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _LAST_F.pop(ctx.client, None)  # the forward that made it is over
        return ctx.client.all_reduce(grad, "sum"), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """The ``g`` function in the paper: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, client: Any) -> torch.Tensor:
        return client.all_reduce(x, "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _take(x: torch.Tensor, mine: Sequence[range]) -> torch.Tensor:
    """This rank's ranges of the last dim of ``x``, concatenated."""
    pieces = [x.narrow(-1, r.start, len(r)) for r in mine]
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, -1)).contiguous()


def _assemble(parts: Sequence[torch.Tensor], ranges: Ranges) -> torch.Tensor:
    """The whole last dim from every rank's part (the inverse of ``_take``)."""
    pieces = []  # (start in the whole dim, tensor)
    for part, mine in zip(parts, ranges, strict=True):
        offset = 0
        for r in mine:
            pieces.append((r.start, part.narrow(-1, offset, len(r))))
            offset += len(r)
    pieces.sort(key=lambda p: p[0])
    return torch.cat([t for _, t in pieces], -1)


def _equal_ranges(size: int, parts: int) -> list[list[range]]:
    width = size // parts
    return [[range(i * width, (i + 1) * width)] for i in range(parts)]


class _GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dim forward (every rank's part put in its place); backward
    keeps this rank's part of the gradient (no RPC)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, client: Any, ranges: Ranges | None) -> torch.Tensor:
        parts = client.all_gather(x)
        if ranges is None:
            ranges = _equal_ranges(sum(p.shape[-1] for p in parts), client.world_size)
        ctx.mine = ranges[client.rank]
        return _assemble(parts, ranges)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _take(grad, ctx.mine), None, None


class _ScatterToTensorParallel(torch.autograd.Function):
    """Keeps this rank's part of the last dim forward (no RPC); all-gathers backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, client: Any, ranges: Ranges | None) -> torch.Tensor:
        if ranges is None:
            ranges = _equal_ranges(x.shape[-1], client.world_size)
        ctx.client, ctx.ranges = client, ranges
        return _take(x, ranges[client.rank])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _assemble(ctx.client.all_gather(grad.contiguous()), ctx.ranges), None, None


def _claim(x: torch.Tensor, tp_client: Any, what: str) -> None:
    """A backward will wait for the group here: the group's ranks may not share a CUDA device
    from threads of one process (strategies/device.py)."""
    if x.requires_grad and torch.is_grad_enabled():
        claim_backward_device(x.device, tp_client, what)


def copy_to_tensor_parallel(x: torch.Tensor, tp_client: Any) -> torch.Tensor:
    """Megatron's ``f``; a no-op on a group of one.

    Layers that read the same input one after another (q, k and v of an attention; gate and up
    of a gated MLP) share one ``f``: autograd sums their input gradients before its backward,
    so one all-reduce serves them all instead of one each (Megatron's fused QKV gets this by
    packing). The last ``f`` of the group is reused while its input is the very tensor, not
    changed in place since; the group's backward forgets it (autograd saves tensors without
    their Python objects, so the output is held here until then).
    """
    if tp_client.world_size == 1:
        return x
    _claim(x, tp_client, "tensor parallelism's all-reduce of input gradients")
    last = _LAST_F.get(tp_client)
    if last is not None:
        seen, version, out = last
        if seen() is x and version == x._version:
            return out
    out = _CopyToTensorParallel.apply(x, tp_client)
    _LAST_F[tp_client] = (weakref.ref(x), x._version, out)
    return out


def reduce_from_tensor_parallel(x: torch.Tensor, tp_client: Any) -> torch.Tensor:
    """Megatron's ``g``; a no-op on a group of one."""
    return x if tp_client.world_size == 1 else _ReduceFromTensorParallel.apply(x, tp_client)


def gather_from_tensor_parallel(
    x: torch.Tensor, tp_client: Any, ranges: Ranges | None = None
) -> torch.Tensor:
    """The whole last dim from every rank's part ``x`` (rank ``r`` holds ``ranges[r]`` of it;
    default: equal parts in rank order)."""
    if tp_client.world_size == 1:
        return x
    return _GatherFromTensorParallel.apply(x, tp_client, ranges)


def scatter_to_tensor_parallel(
    x: torch.Tensor, tp_client: Any, ranges: Ranges | None = None
) -> torch.Tensor:
    """This rank's part of the last dim of ``x`` (``ranges[rank]``; default: its equal part)."""
    if tp_client.world_size == 1:
        return x
    _claim(x, tp_client, "tensor parallelism's all-gather of input gradients")
    return _ScatterToTensorParallel.apply(x, tp_client, ranges)


_EAGER: dict[Callable, Callable] = {}


def eagerly(fn: Callable) -> Callable:
    """``fn``, one of the collectives above, as ``torch.compile`` never traces it: a compiled
    region (a block holding parallel layers) breaks there, where dynamo traced into the client
    and failed on its buffers. Made when a parallel layer is built (``warm``), not at import:
    torch's compiler takes about 2 s to import, and a rank that never compiles should not
    pay for it."""
    made = _EAGER.get(fn)
    if made is None:
        reason = "tensor parallelism's RPCs run eagerly"
        made = _EAGER[fn] = torch.compiler.disable(fn, recursive=True, reason=reason)
    return made


def warm() -> None:
    """Makes the collectives' eager forms, outside any compiled region."""
    for fn in (
        copy_to_tensor_parallel,
        reduce_from_tensor_parallel,
        gather_from_tensor_parallel,
        scatter_to_tensor_parallel,
    ):
        eagerly(fn)
