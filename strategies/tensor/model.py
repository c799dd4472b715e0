"""``TensorParallelModel``: any model split over a tensor-parallel group by a plan.

The tensor-parallel counterpart of torch's ``parallelize_module``, as one module a training
script can hold:

    model = TensorParallelModel(GPT(cfg), config)          # the whole world is the group
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)   # this rank's parts + replicas
    loss = lm_loss(model(x), y); loss.backward()           # every rank: the same batch
    model.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

Every rank of the group must feed the same input. The replicated parameters (embeddings,
layer norms, row-parallel biases) then get the same gradient on every rank, so a plain torch
optimizer on each rank keeps them equal. For data parallelism on top, use
``HybridShardedModel`` (which also puts the optimizer on the servers).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from paramshard.strategies.config import ShardingConfiguration
from paramshard.strategies.layout import incompatible_keys, norm_tensor
from paramshard.strategies.tensor.gather import (
    gather_tensor_parallel_state,
    tensor_parallel_part,
    tensor_splits,
)
from paramshard.strategies.tensor.plans import parallelize_module
from paramshard.strategies.tensor.random_state import same_draws

__all__ = ["TensorParallelModel"]


class TensorParallelModel(nn.Module):
    """``model`` split over ``tp_client`` (default: ``config.client``, the whole world) by
    ``parallelize_plan`` ({module-name pattern: style}; default: the model's own,
    ``strategies.tensor.default_plan``).

    The modules are split in place, copying this rank's part of the weights; every rank must
    start from the same weights (same seed, or load the same state dict).
    """

    def __init__(
        self,
        model: nn.Module,
        config: ShardingConfiguration,
        tp_client: Any = None,
        parallelize_plan: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp_client if tp_client is not None else config.client
        self.tp.deterministic = config.deterministic  # Megatron's all-reduces: rank order
        self._full_keys = list(model.state_dict().keys())
        self.module = parallelize_module(model, self.tp, parallelize_plan)
        self.splits = tensor_splits(self.module) if self.tp.world_size > 1 else {}
        """Parameter name -> how this rank's tensor is a part of the whole (``TensorSplit``)."""

    @property
    def tensor_parallel_rank(self) -> int:
        return self.tp.rank

    @property
    def tensor_parallel_size(self) -> int:
        return self.tp.world_size

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.module(*args, **kwargs)
        with same_draws(self.tp, "TensorParallelModel"):  # dropout: one draw for the group
            return self.module(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips every gradient by the whole model's 2-norm, as
        ``torch.nn.utils.clip_grad_norm_`` on the unsplit model would: the parts' squares are
        summed over the group (one all-reduce), the replicated tensors counted once. Returns
        that norm (the same on every rank)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_ supports the 2-norm only, got norm_type={norm_type}")
        sharded, replicated = 0.0, 0.0
        grads = []
        for name, p in self.module.named_parameters():
            if p.grad is None:
                continue
            grads.append(p.grad)
            sq = float(p.grad.detach().double().pow(2).sum())
            if name in self.splits:
                sharded += sq
            else:
                replicated += sq
        if self.tp.world_size > 1:
            sharded = float(self.tp.all_reduce(torch.tensor([sharded], dtype=torch.float64))[0])
        total = math.sqrt(sharded + replicated)
        coef = min(1.0, float(max_norm) / (total + 1e-6))
        if coef < 1.0:
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
        return norm_tensor(total, (g.dtype for g in grads))

    # -- the whole model -------------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The unsplit model's state dict under its own names, on every rank (one all-gather
        over the group)."""
        full = gather_tensor_parallel_state(self.module, self.tp)
        return {k: full[k] for k in self._full_keys if k in full}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Loads the unsplit model's state dict: each rank keeps its part of the split tensors.
        No communication."""
        own = self.module.state_dict(keep_vars=True)
        keys = incompatible_keys(own, state_dict, strict)
        with torch.no_grad():
            for name, t in own.items():
                if name not in state_dict:
                    continue
                value = torch.as_tensor(state_dict[name])
                split = self.splits.get(name)
                if split is not None:
                    value = tensor_parallel_part(value, **split.fields())
                if value.shape != t.shape:
                    raise ValueError(
                        f"load_state_dict: '{name}' has shape {list(value.shape)}"
                        f"{' (its part)' if split is not None else ''}, the model"
                        f" {list(t.shape)}"
                    )
                t.copy_(value)
        return keys
