"""The whole tensors of a tensor-parallel module: gathering its parts, and cutting parts out.

Parameters keep the original model's names and orientation (``blocks.0.attn.c_attn.weight``
is this rank's part of that weight), so ``gather_tensor_parallel_state`` gives back the
original model's state dict and ``tensor_parallel_part`` the inverse.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paramshard.strategies.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorSplit,
    part_ranges,
)

__all__ = [
    "tensor_splits",
    "tensor_parallel_splits",
    "tensor_parallel_part",
    "gather_tensor_parallel_state",
    "gather_tensor_parallel_grads",
]


def tensor_splits(module: nn.Module) -> dict[str, TensorSplit]:
    """Name -> ``TensorSplit`` of every tensor-parallel part under ``module`` (full names, as
    in its ``state_dict``), on any group size."""
    out = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
            dot = f"{prefix}." if prefix else ""
            out.update({f"{dot}{name}": split for name, split in sub.tensor_splits().items()})
    return out


def tensor_parallel_splits(module: nn.Module, tp_client: Any) -> dict[str, dict[str, int]]:
    """Parameter name -> how this rank's tensor is a part of the whole one (the split fields of
    ``client.ParamInfo`` / ``ParamEntry``: ``split_dim``, ``split_parts``, ``split_index``,
    ``split_packed``, ``split_unit``), for every tensor-parallel parameter under ``module``;
    empty on a group of one. The servers keep this in their manifests, so export can put the
    whole tensors back together without the model's code.

    With ``split_unit`` they say which ranges of the whole tensor the part holds
    (``protos.slicing.tensor_parallel_ranges``), uneven parts (3 heads on 2 ranks) included."""
    if tp_client.world_size == 1:
        return {}
    return {name: split.fields() for name, split in tensor_splits(module).items()}


def tensor_parallel_part(
    whole: torch.Tensor,
    split_dim: int,
    split_parts: int,
    split_index: int,
    split_packed: int = 1,
    split_unit: int = 1,
) -> torch.Tensor:
    """Part ``split_index`` of the whole tensor (the inverse of the gather): its ranges of
    ``split_dim`` (one per packed block, in whole ``split_unit``s; ``layers.part_ranges``),
    concatenated."""
    ranges = part_ranges(whole.shape[split_dim], split_parts, split_index, split_packed, split_unit)
    parts = [whole.narrow(split_dim, r.start, len(r)) for r in ranges]
    return torch.cat(parts, split_dim).clone()


def _place(parts: list[torch.Tensor], split: TensorSplit) -> torch.Tensor:
    """The whole tensor from every rank's part."""
    pieces = []
    for index, part in enumerate(parts):
        offset = 0
        for r in split.ranges(index):
            pieces.append((r.start, part.narrow(split.dim, offset, len(r))))
            offset += len(r)
    pieces.sort(key=lambda p: p[0])
    return torch.cat([t for _, t in pieces], split.dim)


def _part_shape(local: torch.Tensor, split: TensorSplit, index: int) -> list[int]:
    shape = list(local.shape)
    shape[split.dim] = sum(len(r) for r in split.ranges(index))
    return shape


def _gather(tensors: dict[str, torch.Tensor], module: nn.Module, tp_client: Any) -> dict:
    """Whole tensors: the parts all-gathered in one collective and put back together."""
    splits = tensor_splits(module)
    sharded = [name for name in tensors if name in splits]
    out = {name: t.detach().clone() for name, t in tensors.items() if name not in splits}
    if not sharded or tp_client.world_size == 1:
        out.update({name: tensors[name].detach().clone() for name in sharded})
        return {name: out[name] for name in tensors}
    # One all-gather for the whole module: every rank's parts flattened end to end. Every rank
    # knows every rank's part shapes (the split rule), so it can cut the others' buffers.
    flat = torch.cat([tensors[name].detach().reshape(-1) for name in sharded])
    per_rank = tp_client.all_gather(flat)
    offsets = [0] * tp_client.world_size
    for name in sharded:
        split, parts = splits[name], []
        for index, buffer in enumerate(per_rank):
            shape = _part_shape(tensors[name], split, index)
            n = int(torch.Size(shape).numel())
            parts.append(buffer[offsets[index] : offsets[index] + n].view(shape))
            offsets[index] += n
        out[name] = _place(parts, split)
    return {name: out[name] for name in tensors}


def gather_tensor_parallel_state(
    module: nn.Module, tp_client: Any, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """``module``'s state dict (or ``state``, one under the same names) with every
    tensor-parallel part whole again, under the original names and orientation (a packed
    ``c_attn.weight`` re-assembled in q|k|v order). One all-gather; every rank calls it and
    gets the same dict."""
    return _gather(module.state_dict() if state is None else state, module, tp_client)


def gather_tensor_parallel_grads(module: nn.Module, tp_client: Any) -> dict[str, torch.Tensor]:
    """Parameter name -> whole gradient (zeros where a parameter has none), like
    ``gather_tensor_parallel_state``."""
    grads = {
        name: p.grad if p.grad is not None else torch.zeros_like(p)
        for name, p in module.named_parameters()
    }
    return _gather(grads, module, tp_client)
