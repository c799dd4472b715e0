"""A pipeline step's inputs: the forward's arguments, cut into equal micro-batches."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["call_args", "micro_batches"]


def call_args(x: Any, inputs: dict[str, Any], no_cache: bool) -> tuple[tuple, dict]:
    """The forward's (args, kwargs): ``x`` positional, or keywords when it is a dict, then
    ``inputs``; ``no_cache`` adds ``use_cache=False`` (a cache across micro-batches means
    nothing here) unless the caller set it."""
    kwargs = dict(inputs)
    if isinstance(x, dict):
        kwargs.update(x)
        args: tuple = ()
    else:
        args = () if x is None else (x,)
    if no_cache and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


def micro_batches(
    call: tuple[tuple, dict], y: Any, m: int, stage: int, is_last: bool
) -> list[tuple[tuple, dict, Any]]:
    """``m`` (args, kwargs, y) micro-batches: every tensor whose first dimension is the batch
    is cut along it, anything else is passed to each; ``y`` is checked on the last stage."""
    args, kwargs = call
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ValueError(f"stage {stage} needs x (every stage runs the inputs)")
    batch = tensors[0].shape[0] if tensors[0].dim() else 0
    if batch % m != 0:
        raise ValueError(
            f"batch size {batch} of x is not divisible by micro_batch_count {m};"
            " equal micro-batches keep the 1/m loss scaling exact"
        )

    def cut(t: Any) -> list[Any]:
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch:
            return list(t.chunk(m))
        return [t] * m

    a = [cut(t) for t in args]
    kw = {k: cut(t) for k, t in kwargs.items()}
    if y is not None and is_last and y.shape[0] != batch:
        raise ValueError(f"batch size {y.shape[0]} of y differs from x's {batch}")
    ys = cut(y) if y is not None else [None] * m
    return [(tuple(t[i] for t in a), {k: v[i] for k, v in kw.items()}, ys[i]) for i in range(m)]
