"""Column- and row-parallel linear layers (Megatron-LM, arXiv 1909.08053, §3).

- ``ColumnParallelLinear`` splits the output features; its input passes through ``f``
  (identity forward, all-reduce backward), its output stays split unless ``gather_output``.
- ``RowParallelLinear`` splits the input features; the partial products are summed by ``g``
  (all-reduce forward, identity backward), then the bias is added once.

Both hold their part in the layout of the layer they replace, under the same parameter names:
``nn.Linear``'s ``weight`` is [out, in], Hugging Face GPT-2's ``Conv1D`` keeps [in, out]. So a
column part of a ``Linear`` is split along dim 0 and of a ``Conv1D`` along dim 1, and a state
dict gathered from the parts is the original model's.

Which part a rank holds is the one rule of ``protos.slicing.tensor_parallel_ranges``: equal
parts when the dim splits evenly (Megatron's), otherwise the slice rule (the first ``n mod N``
ranks get one more), counted in whole ``unit``s (a head's width for attention projections).
A ``packed`` dim (q|k|v side by side in one weight) gives each rank its part of every block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from paramshard.protos import slicing
from paramshard.protos.manifest import ParamSplit
from paramshard.strategies.tensor.communications import (
    copy_to_tensor_parallel,
    eagerly,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
    warm,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorSplit",
    "part_ranges",
    "layout_of",
]

Layout = Literal["linear", "conv1d"]


part_ranges = slicing.tensor_parallel_ranges  # (size, parts, index, packed=1, unit=1)


@dataclass(frozen=True)
class TensorSplit(ParamSplit):
    """How one parameter of a tensor-parallel layer is a part of the whole tensor: the
    manifest's ``ParamSplit`` (whose ``fields()`` go to the servers) plus the whole length of
    the split dim, which the layer knows."""

    size: int = 0
    """``dim``'s length in the whole tensor."""

    def ranges(self, index: int | None = None) -> list[range]:
        """The ranges of ``dim`` that part ``index`` (default: this one) holds."""
        i = self.index if index is None else index
        return part_ranges(self.size, self.parts, i, self.packed, self.unit)


def layout_of(module: nn.Module) -> tuple[Layout, int, int]:
    """(layout, in_features, out_features) of an ``nn.Linear`` or a GPT-2 ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return "linear", module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return "conv1d", module.nx, module.nf
    raise ValueError(
        f"tensor-parallel styles split nn.Linear or transformers' Conv1D, not"
        f" {type(module).__name__}"
    )


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: Layout):
    """``x W^T + b`` (Linear) or ``x W + b`` (Conv1D, as ``transformers.pytorch_utils``)."""
    if layout == "linear":
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.size(-1))
    y = flat @ weight if bias is None else torch.addmm(bias, flat, weight)
    return y.view(*x.shape[:-1], weight.shape[1])


def _init_uniform(shape: tuple[int, ...], fan_in: int, dtype: Any, device: Any) -> nn.Parameter:
    # nn.Linear's default init: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
    bound = 1.0 / math.sqrt(fan_in) if fan_in else 0.0
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device).uniform_(-bound, bound))


class _ParallelLinear(nn.Module):
    """What both layers share: the split of one dim, the layout, the parameters' records."""

    in_features: int
    out_features: int
    layout: Layout
    split_size: int  # the whole length of the split feature dim
    packed: int
    unit: int

    def _set_split(self, size: int, packed: int, unit: int, tp_client: Any, what: str) -> int:
        if packed < 1 or size % packed:
            raise ValueError(f"{what} ({size}) do not split into {packed} packed blocks")
        block = size // packed
        if unit < 1 or block % unit:
            raise ValueError(f"{what}: a block of {block} is not a whole number of units of {unit}")
        if block // unit < tp_client.world_size:
            raise ValueError(
                f"{what}: {block // unit} unit(s) of {unit} per block cannot be split over"
                f" tensor_parallel_size={tp_client.world_size} (a rank would hold none)"
            )
        self.tp_client, self.split_size, self.packed, self.unit = tp_client, size, packed, unit
        return sum(len(r) for r in self.ranges())

    def ranges(self, index: int | None = None) -> list[range]:
        """The ranges of the whole split feature dim that rank ``index`` (default: this one)
        holds."""
        i = self.tp_client.rank if index is None else index
        return part_ranges(self.split_size, self.tp_client.world_size, i, self.packed, self.unit)

    def all_ranges(self) -> list[list[range]]:
        return [self.ranges(r) for r in range(self.tp_client.world_size)]

    def _split(self, dim: int) -> TensorSplit:
        tp = self.tp_client
        return TensorSplit(
            dim, tp.world_size, tp.rank, self.packed, self.unit, size=self.split_size
        )

    def _take(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        pieces = [t.detach().narrow(dim, r.start, len(r)) for r in self.ranges()]
        return torch.cat(pieces, dim).clone()

    def _copy_from(self, module: nn.Module, weight_dim: int, split_bias: bool) -> None:
        """This rank's part of ``module``'s weight (and bias); at tensor_parallel_size 1 the
        module's own parameters, so ties and optimizers holding them keep working."""
        whole = self.tp_client.world_size == 1
        w, b = module.weight, module.bias
        self.weight = w if whole else nn.Parameter(self._take(w, weight_dim), w.requires_grad)
        if b is None:
            self.bias = None
        elif whole or not split_bias:
            self.bias = b if whole else nn.Parameter(b.detach().clone(), b.requires_grad)
        else:
            self.bias = nn.Parameter(self._take(b, 0), b.requires_grad)


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with the output features split over the group.

    Holds this rank's ranges of the output features (``ranges()``) of the weight and bias; its
    output is this rank's part of the features, or the whole of them with ``gather_output``
    (an all-gather). ``packed`` > 1: the output features are that many equal blocks side by
    side (q|k|v), and each rank takes its part of each, so its output is q_r|k_r|v_r.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_client: Any,
        bias: bool = True,
        gather_output: bool = False,
        dtype: torch.dtype | None = None,
        *,
        packed: int = 1,
        unit: int = 1,
        layout: Layout = "linear",
        device: Any = None,
    ) -> None:
        super().__init__()
        warm()  # the collectives' eager forms, before any compiled forward
        self.in_features, self.out_features, self.layout = in_features, out_features, layout
        self.gather_output = gather_output
        local = self._set_split(out_features, packed, unit, tp_client, "ColumnParallelLinear")
        shape = (local, in_features) if layout == "linear" else (in_features, local)
        self.weight = _init_uniform(shape, in_features, dtype, device)
        self.bias = _init_uniform((local,), in_features, dtype, device) if bias else None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Module,
        tp_client: Any,
        *,
        gather_output: bool = False,
        packed: int = 1,
        unit: int = 1,
    ) -> ColumnParallelLinear:
        """This rank's part of ``linear`` (an ``nn.Linear`` or a ``Conv1D``), in its layout and
        dtype (float64 stays float64)."""
        layout, inp, out = layout_of(linear)
        layer = cls(
            inp,
            out,
            tp_client,
            linear.bias is not None,
            gather_output,
            linear.weight.dtype,
            packed=packed,
            unit=unit,
            layout=layout,
            device="meta",
        )
        layer._copy_from(linear, 0 if layout == "linear" else 1, split_bias=True)
        return layer

    def tensor_splits(self) -> dict[str, TensorSplit]:
        """Parameter name (in this module) -> how it is a part of the whole tensor."""
        out = {"weight": self._split(0 if self.layout == "linear" else 1)}
        if self.bias is not None:
            out["bias"] = self._split(0)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = eagerly(copy_to_tensor_parallel)(x, self.tp_client)
        y = _matmul(x, self.weight, self.bias, self.layout)
        if self.gather_output:
            return eagerly(gather_from_tensor_parallel)(y, self.tp_client, self.all_ranges())
        return y

    def extra_repr(self) -> str:
        local = sum(len(r) for r in self.ranges())
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.tp_client.world_size}, local_out={local}, packed={self.packed}, "
            f"unit={self.unit}, layout={self.layout}, gather_output={self.gather_output}"
        )


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with the input features split over the group.

    Holds this rank's ranges of the input features of the weight, and the whole bias, which is
    added once, after the partial products are summed. The input is this rank's part of the
    features (``input_is_parallel``, the output of a column-parallel layer) or the whole input,
    which is then split.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_client: Any,
        bias: bool = True,
        input_is_parallel: bool = True,
        dtype: torch.dtype | None = None,
        *,
        unit: int = 1,
        layout: Layout = "linear",
        device: Any = None,
    ) -> None:
        super().__init__()
        warm()  # the collectives' eager forms, before any compiled forward
        self.in_features, self.out_features, self.layout = in_features, out_features, layout
        self.input_is_parallel = input_is_parallel
        local = self._set_split(in_features, 1, unit, tp_client, "RowParallelLinear")
        shape = (out_features, local) if layout == "linear" else (local, out_features)
        self.weight = _init_uniform(shape, in_features, dtype, device)
        self.bias = _init_uniform((out_features,), in_features, dtype, device) if bias else None

    @classmethod
    def from_linear(
        cls, linear: nn.Module, tp_client: Any, *, input_is_parallel: bool = True, unit: int = 1
    ) -> RowParallelLinear:
        """This rank's part of ``linear`` (its input features; the bias whole)."""
        layout, inp, out = layout_of(linear)
        layer = cls(
            inp,
            out,
            tp_client,
            linear.bias is not None,
            input_is_parallel,
            linear.weight.dtype,
            unit=unit,
            layout=layout,
            device="meta",
        )
        layer._copy_from(linear, 1 if layout == "linear" else 0, split_bias=False)
        return layer

    def tensor_splits(self) -> dict[str, TensorSplit]:
        """Parameter name (in this module) -> how it is a part of the whole tensor (the bias is
        whole)."""
        return {"weight": self._split(1 if self.layout == "linear" else 0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_client.world_size == 1:  # the plain layer's own arithmetic
            return _matmul(x, self.weight, self.bias, self.layout)
        if not self.input_is_parallel:
            x = eagerly(scatter_to_tensor_parallel)(x, self.tp_client, self.all_ranges())
        y = _matmul(x, self.weight, None, self.layout)
        y = eagerly(reduce_from_tensor_parallel)(y, self.tp_client)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        local = sum(len(r) for r in self.ranges())
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.tp_client.world_size}, local_in={local}, unit={self.unit}, "
            f"layout={self.layout}, input_is_parallel={self.input_is_parallel}"
        )
