"""Tensor parallelism for GPT blocks, after Megatron-LM (Shoeybi et al., arXiv 1909.08053).

Each rank of a tensor-parallel group holds 1/tp of every attention and MLP matrix:

- ``ColumnParallelLinear`` splits the output features (rows of ``weight``); its input passes
  through ``f`` (identity forward, all-reduce backward), its output stays split.
- ``RowParallelLinear`` splits the input features (columns of ``weight``); the partial
  products are summed by ``g`` (all-reduce forward, identity backward), then the bias is added
  once.
- Attention splits by heads (§3, Fig. 3a): each rank takes its heads from each of q, k and v
  (GPT-2's ``c_attn`` packs them as q|k|v), runs attention on them alone, and ``c_proj`` is
  row-parallel. The MLP's ``c_fc`` is column-parallel and ``c_proj`` row-parallel (Fig. 3b), so
  GeLU needs no communication.

So a block costs two all-reduces forward (after attention, after the MLP) and two backward
(the gradients reaching ``c_attn`` and ``c_fc`` inputs), each one RPC round trip through the
servers. Embeddings, layer norms and ``lm_head`` stay replicated; their gradients come out
equal on every rank because ``f`` makes the input gradients whole.

Parameters keep their GPT names (``blocks.0.attn.c_attn.weight`` is this rank's shard of that
weight), so ``gather_tensor_parallel_state`` gives back the plain model's state dict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from protos import slicing

__all__ = [
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "gather_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelCausalSelfAttention",
    "ParallelMLP",
    "parallelize_gpt_blocks",
    "gather_tensor_parallel_state",
    "gather_tensor_parallel_grads",
    "tensor_parallel_splits",
    "tensor_parallel_part",
]


# -- communication: Megatron's f and g, and the gather/scatter pair -----------------------------
class _CopyToTensorParallel(torch.autograd.Function):
    """The ``f`` function in the paper (arXiv 1909.08053, §3): identity forward, all-reduce
    of the input gradient backward (each rank holds only its slice's contribution to it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, client: Any) -> torch.Tensor:
        ctx.client = client
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.client.all_reduce(grad, "sum"), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """The ``g`` function in the paper: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, client: Any) -> torch.Tensor:
        return client.all_reduce(x, "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dim forward; backward keeps this rank's part (no RPC)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, client: Any) -> torch.Tensor:
        ctx.rank, ctx.world_size = client.rank, client.world_size
        return torch.cat(client.all_gather(x), dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.chunk(ctx.world_size, dim=-1)[ctx.rank].contiguous(), None


class _ScatterToTensorParallel(torch.autograd.Function):
    """Keeps this rank's part of the last dim forward (no RPC); all-gathers backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, client: Any) -> torch.Tensor:
        ctx.client = client
        return x.chunk(client.world_size, dim=-1)[client.rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.cat(ctx.client.all_gather(grad), dim=-1), None


def copy_to_tensor_parallel(x: torch.Tensor, tp_client: Any) -> torch.Tensor:
    """Megatron's ``f``; a no-op on a group of one."""
    return x if tp_client.world_size == 1 else _CopyToTensorParallel.apply(x, tp_client)


def reduce_from_tensor_parallel(x: torch.Tensor, tp_client: Any) -> torch.Tensor:
    """Megatron's ``g``; a no-op on a group of one."""
    return x if tp_client.world_size == 1 else _ReduceFromTensorParallel.apply(x, tp_client)


def gather_from_tensor_parallel(x: torch.Tensor, tp_client: Any) -> torch.Tensor:
    """Every rank's ``x`` concatenated along the last dim, in rank order."""
    return x if tp_client.world_size == 1 else _GatherFromTensorParallel.apply(x, tp_client)


def scatter_to_tensor_parallel(x: torch.Tensor, tp_client: Any) -> torch.Tensor:
    """This rank's equal part of the last dim of ``x``."""
    return x if tp_client.world_size == 1 else _ScatterToTensorParallel.apply(x, tp_client)


def _shard_size(size: int, parts: int, what: str) -> int:
    """``size // parts``; Megatron's splits are equal, so ``parts`` must divide ``size``."""
    if size % parts:
        raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel size ({parts})")
    return size // parts


# -- layers ------------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s rows (output features) split over the group.

    Holds rows ``[rank * out/tp, (rank + 1) * out/tp)`` of the weight and bias. The output is
    this rank's slice of the features unless ``gather_output`` (an all-gather).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_client: Any,
        bias: bool = True,
        gather_output: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        local = _shard_size(out_features, tp_client.world_size, "ColumnParallelLinear out_features")
        self.in_features, self.out_features = in_features, out_features
        self.tp_client, self.gather_output = tp_client, gather_output
        self.num_packed = 1  # see from_linear
        # nn.Linear's default init: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
        bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
        w = torch.empty(local, in_features, dtype=dtype).uniform_(-bound, bound)
        self.weight = nn.Parameter(w)
        b = torch.empty(local, dtype=dtype).uniform_(-bound, bound) if bias else None
        self.bias = nn.Parameter(b) if b is not None else None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, tp_client: Any, *, gather_output: bool = False, num_packed: int = 1
    ) -> ColumnParallelLinear:
        """This rank's shard of ``linear``. ``num_packed`` > 1 means the output features are
        ``num_packed`` equal blocks side by side (``c_attn``'s q|k|v): the rank then takes its
        slice of each block, so its output is q_r|k_r|v_r."""
        out, inp = linear.weight.shape
        if num_packed < 1 or out % num_packed:
            raise ValueError(
                f"ColumnParallelLinear: out_features ({out}) do not split into {num_packed} blocks"
            )
        _shard_size(out // num_packed, tp_client.world_size, "ColumnParallelLinear packed block")
        dtype = linear.weight.dtype  # float64 stays float64
        layer = cls(inp, out, tp_client, linear.bias is not None, gather_output, dtype)
        layer.num_packed = num_packed
        with torch.no_grad():
            layer.weight.copy_(_take_rows(linear.weight, num_packed, tp_client))
            if linear.bias is not None:
                layer.bias.copy_(_take_rows(linear.bias, num_packed, tp_client))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tensor_parallel(x, self.tp_client), self.weight, self.bias)
        return gather_from_tensor_parallel(y, self.tp_client) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.tp_client.world_size}, local_out={self.weight.shape[0]}"
        )


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s columns (input features) split over the group.

    Holds columns ``[rank * in/tp, (rank + 1) * in/tp)`` of the weight and the whole bias,
    which is added once, after the partial products are summed. The input is this rank's slice
    of the features (``input_is_parallel``) or the whole input, which is then split.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_client: Any,
        bias: bool = True,
        input_is_parallel: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        local = _shard_size(in_features, tp_client.world_size, "RowParallelLinear in_features")
        self.in_features, self.out_features = in_features, out_features
        self.tp_client, self.input_is_parallel = tp_client, input_is_parallel
        bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
        w = torch.empty(out_features, local, dtype=dtype).uniform_(-bound, bound)
        self.weight = nn.Parameter(w)
        b = torch.empty(out_features, dtype=dtype).uniform_(-bound, bound) if bias else None
        self.bias = nn.Parameter(b) if b is not None else None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, tp_client: Any, *, input_is_parallel: bool = True
    ) -> RowParallelLinear:
        """This rank's shard of ``linear`` (its columns; the bias whole)."""
        out, inp = linear.weight.shape
        dtype = linear.weight.dtype
        layer = cls(inp, out, tp_client, linear.bias is not None, input_is_parallel, dtype)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(tp_client.world_size, 1)[tp_client.rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.tp_client)
        y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.tp_client)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.tp_client.world_size}, local_in={self.weight.shape[1]}"
        )


def _take_rows(t: torch.Tensor, num_packed: int, tp_client: Any) -> torch.Tensor:
    blocks = t.detach().chunk(num_packed, dim=0)
    return torch.cat([b.chunk(tp_client.world_size, 0)[tp_client.rank] for b in blocks])


# -- GPT modules -------------------------------------------------------------------------------
class ParallelCausalSelfAttention(nn.Module):
    """``examples.gpt.CausalSelfAttention`` with its heads split over the group."""

    def __init__(self, config: Any, tp_client: Any) -> None:
        super().__init__()
        n_embd, n_head = config.n_embd, config.n_head
        self.n_head = _shard_size(
            n_head, tp_client.world_size, "ParallelCausalSelfAttention n_head"
        )
        self.head_dim = n_embd // n_head
        self.tp_client = tp_client
        self.c_attn = ColumnParallelLinear(n_embd, 3 * n_embd, tp_client, config.bias)
        self.c_attn.num_packed = 3  # q|k|v, each split by heads
        self.c_proj = RowParallelLinear(n_embd, n_embd, tp_client, config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer(
            "mask", mask.view(1, 1, config.block_size, config.block_size), persistent=False
        )

    @classmethod
    def from_module(cls, attn: nn.Module, tp_client: Any) -> ParallelCausalSelfAttention:
        """This rank's heads of a ``CausalSelfAttention`` (weights copied)."""
        n_embd = attn.c_attn.in_features
        config = _Shape(
            n_embd=n_embd,
            n_head=attn.n_head,
            block_size=attn.mask.shape[-1],
            bias=attn.c_attn.bias is not None,
            dropout=attn.attn_dropout.p,
        )
        new = cls(config, tp_client)
        new.c_attn = ColumnParallelLinear.from_linear(attn.c_attn, tp_client, num_packed=3)
        new.c_proj = RowParallelLinear.from_linear(attn.c_proj, tp_client)
        new.resid_dropout.p = attn.resid_dropout.p
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        local = self.n_head * self.head_dim
        q, k, v = self.c_attn(x).split(local, dim=2)
        # (B, T, local) -> (B, local heads, T, head_dim); the same arithmetic as the plain model
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, local)
        return self.resid_dropout(self.c_proj(y))


class ParallelMLP(nn.Module):
    """``examples.gpt.MLP`` with ``c_fc`` column-parallel and ``c_proj`` row-parallel."""

    def __init__(self, config: Any, tp_client: Any) -> None:
        super().__init__()
        n_embd = config.n_embd
        self.c_fc = ColumnParallelLinear(n_embd, 4 * n_embd, tp_client, config.bias)
        self.gelu = nn.GELU()
        self.c_proj = RowParallelLinear(4 * n_embd, n_embd, tp_client, config.bias)
        self.dropout = nn.Dropout(config.dropout)

    @classmethod
    def from_module(cls, mlp: nn.Module, tp_client: Any) -> ParallelMLP:
        """This rank's shard of an ``MLP`` (weights copied)."""
        n_embd, bias = mlp.c_fc.in_features, mlp.c_fc.bias is not None
        new = cls(_Shape(n_embd=n_embd, bias=bias, dropout=mlp.dropout.p), tp_client)
        new.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, tp_client)
        new.c_proj = RowParallelLinear.from_linear(mlp.c_proj, tp_client)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class _Shape:
    """The fields of a GPTConfig the parallel modules read."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def parallelize_gpt_blocks(model_or_blocks: nn.Module | Iterable[nn.Module], tp_client: Any) -> Any:
    """Replaces each Block's ``attn`` and ``mlp`` in place by their tensor-parallel versions,
    copying this rank's shard of the existing weights; returns ``model_or_blocks``.

    Every rank of the group must start from the same weights (same seed, or a broadcast).
    Blocks' layer norms, and a GPT's embeddings, ``ln_f`` and ``lm_head``, stay replicated.
    """
    blocks = getattr(model_or_blocks, "blocks", model_or_blocks)
    for block in blocks:
        if isinstance(block.attn, ParallelCausalSelfAttention):
            raise ValueError("parallelize_gpt_blocks: block is already tensor-parallel")
        block.attn = ParallelCausalSelfAttention.from_module(block.attn, tp_client)
        block.mlp = ParallelMLP.from_module(block.mlp, tp_client)
    return model_or_blocks


# -- gathering full tensors --------------------------------------------------------------------
def _split_dims(module: nn.Module) -> dict[str, tuple[int, int]]:
    """name -> (split dim, num_packed) for every sharded tensor under ``module``."""
    out = {}
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(sub, ColumnParallelLinear):
            out[f"{dot}weight"] = (0, sub.num_packed)
            if sub.bias is not None:
                out[f"{dot}bias"] = (0, sub.num_packed)
        elif isinstance(sub, RowParallelLinear):
            out[f"{dot}weight"] = (1, 1)
    return out


def _gather(tensors: dict[str, torch.Tensor], module: nn.Module, tp_client: Any) -> dict:
    """Full tensors: the sharded ones all-gathered in one collective and re-assembled."""
    split = _split_dims(module)
    sharded = [name for name in tensors if name in split]
    out = {name: t.detach().clone() for name, t in tensors.items() if name not in split}
    if not sharded or tp_client.world_size == 1:
        out.update({name: tensors[name].detach().clone() for name in sharded})
        return {name: out[name] for name in tensors}
    # One all-gather for the whole module: every rank's shards flattened end to end (all ranks'
    # shards have the same shapes, so the offsets are the same everywhere).
    flat = torch.cat([tensors[name].detach().reshape(-1) for name in sharded])
    per_rank = tp_client.all_gather(flat)
    offset = 0
    for name in sharded:
        local = tensors[name]
        n = local.numel()
        parts = [p[offset : offset + n].view_as(local) for p in per_rank]
        offset += n
        dim, packed = split[name]
        blocks = [p.chunk(packed, dim) for p in parts]  # [rank][packed block]
        out[name] = torch.cat([torch.cat([b[i] for b in blocks], dim) for i in range(packed)], dim)
    return {name: out[name] for name in tensors}


def gather_tensor_parallel_state(module: nn.Module, tp_client: Any) -> dict[str, torch.Tensor]:
    """``module``'s state dict with every sharded tensor whole again, under the original GPT
    names (``c_attn.weight`` re-assembled in q|k|v order). One all-gather; every rank calls it
    and gets the same dict."""
    return _gather(module.state_dict(), module, tp_client)


def gather_tensor_parallel_grads(module: nn.Module, tp_client: Any) -> dict[str, torch.Tensor]:
    """Parameter name -> whole gradient (zeros where a parameter has none), like
    ``gather_tensor_parallel_state``."""
    grads = {
        name: p.grad if p.grad is not None else torch.zeros_like(p)
        for name, p in module.named_parameters()
    }
    return _gather(grads, module, tp_client)


def tensor_parallel_splits(module: nn.Module, tp_client: Any) -> dict[str, dict[str, int]]:
    """Parameter name -> how this rank's tensor is a part of the whole one (the split fields of
    ``client.ParamInfo`` / ``ParamEntry``), for every sharded parameter under ``module``;
    empty on a group of one. The servers keep this in their manifests, so export can put
    the whole tensors back together without the model's code."""
    if tp_client.world_size == 1:
        return {}
    return {
        name: {
            "split_dim": dim,
            "split_parts": tp_client.world_size,
            "split_index": tp_client.rank,
            "split_packed": packed,
        }
        for name, (dim, packed) in _split_dims(module).items()
    }


def tensor_parallel_part(
    whole: torch.Tensor, split_dim: int, split_parts: int, split_index: int, split_packed: int = 1
) -> torch.Tensor:
    """Part ``split_index`` of the whole tensor (the inverse of the gather): its slice of each
    of ``split_packed`` blocks along ``split_dim``, concatenated."""
    ranges = slicing.tensor_parallel_ranges(
        whole.shape[split_dim], split_parts, split_index, split_packed
    )
    parts = [whole.narrow(split_dim, r.start, len(r)) for r in ranges]
    return torch.cat(parts, split_dim).clone()
