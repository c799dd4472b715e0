"""What a pipeline stage must not compute with: its stand-ins' zeros (strategies/pipeline/
split.py), and what its first module's arguments were replaced with.

``Replacements`` keeps, for each argument of a stage's first module that a run replaced with
the tensor received from the stage before, that tensor: activation checkpointing calls the
module again in backward, on the arguments it saved (or, torch's reentrant form, their
detached copies), which are the stand-ins' values again, and the recompute must be given what
the run was (else its gradients were those of zeros, silently). ``reached`` walks the autograd
graph of what a stage sends on or returns for a stand-in's zeros.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["Replacements", "reached"]


def _storage(t: torch.Tensor) -> tuple:
    """Where a tensor's values are: the same for a tensor and its detached copies."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))


class Replacements:
    """The first module's arguments a run replaced, weakly, each with what it received."""

    def __init__(self) -> None:
        self._map: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}

    def add(self, original: torch.Tensor, received: torch.Tensor) -> None:
        self._map[_storage(original)] = (weakref.ref(original), received)

    def prune(self) -> None:
        """Forgets the arguments no checkpoint holds any more."""
        self._map = {k: v for k, v in self._map.items() if v[0]() is not None}

    def _of(self, t: torch.Tensor) -> torch.Tensor | None:
        hit = self._map.get(_storage(t))
        return None if hit is None or hit[0]() is None else hit[1]

    def recompute(self, args: tuple, kwargs: dict) -> Any:
        """The first module's arguments for a call outside a run (a checkpoint's recompute):
        with what each replaced one received, or None when none of them is there."""
        if not self._map:
            return None
        leaves, spec = pytree.tree_flatten((args, kwargs))
        swapped = [self._of(x) if isinstance(x, torch.Tensor) else None for x in leaves]
        if not any(t is not None for t in swapped):
            return None
        leaves = [x if t is None else t for x, t in zip(leaves, swapped, strict=True)]
        return pytree.tree_unflatten(leaves, spec)

    def wrapped_by(self, node: Any) -> bool:
        """Whether ``node``, torch's reentrant checkpoint, ran the first module: among the
        inputs it saved is an argument a run replaced (past it, the graph leads to the
        stand-ins' values the replacement took the place of)."""
        saved = getattr(node, "saved_tensors", ())
        return any(self._map.get(_storage(t), (lambda: None,))[0]() is t for t in saved)


def reached(
    results: list[Any], stand_ins: dict[int, tuple[torch.Tensor, str]], replaced: Replacements
) -> str | None:
    """The unit of a stand-in whose zeros ``results`` were computed from, or None. A stand-in
    returned as it is (an encoder's last state a model's output carries along) is not computed
    with, so it is not counted."""
    if not stand_ins:
        return None
    seen: set[Any] = set()
    todo = [t.grad_fn for t in results if isinstance(t, torch.Tensor) and t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad: a leaf tensor
        if leaf is not None and id(leaf) in stand_ins:
            return stand_ins[id(leaf)][1]
        if node.name() == "CheckpointFunctionBackward" and replaced.wrapped_by(node):
            continue  # the first module's arguments were replaced, in the recompute too
        todo.extend(n for n, _ in node.next_functions)
    return None
