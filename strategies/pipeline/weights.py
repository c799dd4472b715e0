"""A meta model's tensors made real, moved, and cut into a rank's parts, and the weights they are
read from: a state dict or safetensors files (a file, a directory, a sharded index), of which
a rank reads its own tensors' ranges only."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch
from torch import nn

from paramshard.strategies.tensor.layers import TensorSplit

__all__ = ["WeightSource", "blank", "make_real", "move_to", "named_tensors", "put", "take"]


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every name of every parameter and buffer (a tied weight under each of its names)."""
    return dict(
        chain(
            module.named_parameters(remove_duplicate=False),
            module.named_buffers(remove_duplicate=False),
        )
    )


def blank(t: torch.Tensor) -> torch.Tensor:
    """A real tensor like ``t``, NaN (zeros for integers) until something sets it."""
    fill = math.nan if t.is_floating_point() or t.is_complex() else 0
    real = torch.full(t.shape, fill, dtype=t.dtype, device="cpu")
    return nn.Parameter(real, t.requires_grad) if isinstance(t, nn.Parameter) else real


def make_real(module: nn.Module) -> None:
    """Every meta tensor of ``module`` becomes real in place: the same Python objects, so the
    ties, the stage skeletons and later the optimizer hold them."""
    for t in {id(t): t for t in named_tensors(module).values() if t.is_meta}.values():
        torch.utils.swap_tensors(t, blank(t))


def move_to(module: nn.Module, device: torch.device) -> None:
    """Every tensor of ``module`` moved to ``device`` in place (the same Python objects)."""
    for t in {id(t): t for t in named_tensors(module).values()}.values():
        if t.device != device:
            moved = t.detach().to(device)
            new = nn.Parameter(moved, t.requires_grad) if isinstance(t, nn.Parameter) else moved
            torch.utils.swap_tensors(t, new)


def take(whole: Any, ndim: int, split: TensorSplit | None) -> torch.Tensor:
    """This rank's part of ``whole`` (a tensor or a safetensors slice): its ranges of the split
    dim (``TensorSplit.ranges``, the one slice rule) end to end; all of it without a split."""
    if split is None:
        return whole[(slice(None),) * ndim]
    pieces = []
    for r in split.ranges():
        index = [slice(None)] * ndim
        index[split.dim] = slice(r.start, r.stop)
        pieces.append(whole[tuple(index)])
    return torch.cat(pieces, split.dim)


def put(whole: torch.Tensor, part: torch.Tensor, split: TensorSplit | None) -> None:
    """The inverse of ``take``: ``part`` written back at its ranges of ``whole``."""
    if split is None:
        whole.copy_(part)
        return
    offset = 0
    for r in split.ranges():
        whole.narrow(split.dim, r.start, len(r)).copy_(part.narrow(split.dim, offset, len(r)))
        offset += len(r)


class WeightSource:
    """Reads a tensor's part by name from a state dict or safetensors files, never more."""

    def __init__(self, init_weights: Any) -> None:
        self.what, self.mapping = "the state dict", init_weights
        if not isinstance(init_weights, Mapping):
            from safetensors import safe_open

            self.what, files = repr(os.fspath(init_weights)), safetensors_files(init_weights)
            opened = {f: safe_open(f, "pt") for f in set(files.values())}
            self.mapping = {k: opened[f] for k, f in files.items()}

    def read(self, names: list[str], shape: torch.Size, split: TensorSplit | None) -> Any:
        """The part of the first of ``names`` the source has (None if it has none)."""
        name = next((n for n in names if n in self.mapping), None)
        if name is None:
            return None
        value = self.mapping[name]
        if isinstance(value, torch.Tensor):
            whole, got = value, list(value.shape)
        else:  # a safetensors file: only the ranges asked for are read
            whole = value.get_slice(name)
            got = whole.get_shape()
        if got != list(shape):
            raise ValueError(
                f"init_weights: {self.what} holds '{name}' of shape {got}, the model {list(shape)}"
            )
        return take(whole, len(got), split)


def safetensors_files(path: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> file, of a .safetensors file or a checkpoint directory."""
    from safetensors import safe_open

    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        path = os.path.join(path, "model.safetensors")
    if not os.path.exists(path):
        raise ValueError(f"init_weights: no {path!r} (nor a model.safetensors.index.json)")
    with safe_open(path, "pt") as f:
        return dict.fromkeys(f.keys(), path)
