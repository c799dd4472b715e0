"""Mixed precision as FSDP2's ``MixedPrecisionPolicy`` defines it: the one place its rules live.

- ``param_dtype`` is the dtype forward and backward compute in. The servers keep the master
  copy and optimizer state in the master dtype (float32, or float64 for float64 parameters);
  FSDP gathers each unit straight into ``param_dtype`` (the servers cast, once per gather),
  ZeRO-1/2 keep a ``param_dtype`` working copy as their replica, and DDP casts its float32
  parameters into a working copy for each forward and back when backward ends (its torch
  optimizer steps the float32 ones, as torch DDP's ``_MixedPrecision`` does).
- ``reduce_dtype`` is the dtype gradients leave the trainer in (``config.reduce_dtype_for``).
- None, the default for both, is the parameters' own dtype: a float64 model stays float64, a
  bfloat16 model computes in bfloat16.
- As FSDP2's ``cast_forward_inputs=True``, floating-point inputs of the root forward are cast
  to ``param_dtype``; outputs stay in it (FSDP2's ``output_dtype=None``), and
  ``train_on_batch`` takes the loss of outputs cast back to the master dtype (float32).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from paramshard.strategies.config import ShardingConfiguration, master_dtype
from paramshard.strategies.layout import BufferSpec, dtype_name, flat_views, torch_dtype

__all__ = [
    "compute_dtype",
    "gather_dtype",
    "compute_views",
    "cast_forward_inputs",
    "outputs_for_loss",
]


def compute_dtype(config: ShardingConfiguration, own: torch.dtype) -> torch.dtype:
    """The dtype a parameter whose own dtype is ``own`` computes in: ``param_dtype`` (as
    ``config.param_dtype_for`` resolves it for its class), or ``own`` when None."""
    if config.param_dtype is None:
        return own
    return torch_dtype(config.param_dtype_for(master_dtype(own)))


def gather_dtype(config: ShardingConfiguration, b: BufferSpec) -> str:
    """The dtype buffer ``b`` is pulled in for compute: its parameters' compute dtype when they
    share one (the server casts, so nothing is cast again here), else the master dtype (each
    parameter then casts its own part)."""
    dtypes = {compute_dtype(config, torch_dtype(e.dtype)) for e in b.entries}
    if len(dtypes) == 1:
        return dtype_name(dtypes.pop())
    return b.master_dtype


def compute_views(
    config: ShardingConfiguration, flat: torch.Tensor, b: BufferSpec
) -> list[torch.Tensor]:
    """Buffer ``b``'s values pulled in ``gather_dtype``, one tensor per parameter in its
    compute dtype (views of ``flat`` unless the buffer mixes compute dtypes)."""
    views = flat_views(flat, b.entries)
    wants = [compute_dtype(config, torch_dtype(e.dtype)) for e in b.entries]
    return [v if v.dtype == want else v.to(want) for v, want in zip(views, wants, strict=True)]


def cast_forward_inputs(
    config: ShardingConfiguration, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every floating-point tensor cast to ``param_dtype`` (FSDP2's
    ``cast_forward_inputs=True`` at the root); unchanged when ``param_dtype`` is None."""
    if config.param_dtype is None:
        return args, kwargs
    dtype = torch_dtype(config.param_dtype)

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, args), tree_map(cast, kwargs)


def outputs_for_loss(config: ShardingConfiguration, out: Any) -> Any:
    """The model's outputs as ``train_on_batch`` hands them to the loss: 16-bit floating
    tensors cast to float32, so the loss is taken in float32 (as under ``torch.autocast``)."""
    if config.param_dtype is None:
        return out

    def widen(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16):
            return x.float()
        return x

    return tree_map(widen, out)
