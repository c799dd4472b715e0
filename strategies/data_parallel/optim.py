"""Optimizer wrappers: a torch optimizer's param groups, stepped by the strategy.

The wrapper *is* a ``torch.optim.Optimizer`` sharing the wrapped optimizer's param-group dicts,
so torch LR schedulers work unchanged; every step sends each group's current hyper-parameters
to the servers (ZeRO / FSDP) or steps the torch optimizer locally (DDP).
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from paramshard.protos.atomic import read_bytes, write_bytes
from paramshard.strategies.base import ShardedModelBase, owner_of
from paramshard.strategies.config import ShardingConfiguration

__all__ = [
    "ShardedOptimizer",
    "DDPOptimizer",
    "ZeRO1Optimizer",
    "ZeRO2Optimizer",
    "FSDPOptimizer",
    "ZeRO3Optimizer",
    "OptimizationInputData",
    "OptimizationResult",
]


@dataclass
class OptimizationInputData:
    """AiDotNet's OptimizationInputData: this rank's share of the training data."""

    x_train: Any
    y_train: Any
    x_validation: Any = None
    y_validation: Any = None
    epochs: int = 1
    batch_size: int | None = None
    """Samples per step on this rank (None: the whole of x_train at once)."""


@dataclass
class OptimizationResult:
    """What ``optimize`` found: losses per step and epoch, and the best parameters."""

    loss_history: list[float] = field(default_factory=list)
    validation_loss_history: list[float] = field(default_factory=list)
    best_parameters: torch.Tensor | None = None
    best_loss: float = math.inf
    epochs_run: int = 0
    stopped_early: bool = False


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` (built from ``model.parameters()``) for a sharded model."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: ShardingConfiguration,
        model: ShardedModelBase | None = None,
        *,
        patience: int = 5,
        min_delta: float = 0.0,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.model = model if model is not None else owner_of(params)
        self.inner = optimizer
        self.config = config
        self.patience = patience
        self.min_delta = min_delta
        self._validation_losses: list[float] = []
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups  # the same dicts: schedulers edit both
        self.state = optimizer.state
        self.model._attach(self)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.model._optimizer_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    # -- AiDotNet's surface ----------------------------------------------------------------
    def optimize(self, data: OptimizationInputData) -> OptimizationResult:
        """Epochs of ``train_on_batch`` over this rank's data; tracks the validation loss
        (training loss if there is no validation set) and keeps the best parameters."""
        result = OptimizationResult()
        n = len(data.x_train)
        size = data.batch_size or n
        for _ in range(data.epochs):
            epoch_losses = []
            for start in range(0, n, size):
                xb, yb = data.x_train[start : start + size], data.y_train[start : start + size]
                epoch_losses.append(self.model.train_on_batch(xb, yb))
            result.loss_history += epoch_losses
            if data.x_validation is not None:
                out = self.model.predict(data.x_validation)
                score = float(self.model.default_loss_function(out, data.y_validation))
            else:
                score = sum(epoch_losses) / len(epoch_losses)
            result.validation_loss_history.append(score)
            self._validation_losses.append(score)
            result.epochs_run += 1
            if score < result.best_loss:
                result.best_loss = score
                result.best_parameters = self.model.get_parameters()
            if self.should_early_stop():
                result.stopped_early = True
                break
        return result

    def should_early_stop(self) -> bool:
        """True once the validation loss has not improved by ``min_delta`` for ``patience``
        evaluations."""
        losses = self._validation_losses
        if len(losses) <= self.patience:
            return False
        best_before = min(losses[: -self.patience])
        return min(losses[-self.patience :]) > best_before - self.min_delta

    def get_options(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {
            "optimizer": type(self.inner).__name__,
            "strategy": self.model.strategy,
            "param_groups": groups,
            "patience": self.patience,
            "min_delta": self.min_delta,
        }

    def synchronize_optimizer_state(self) -> None:
        """ZeRO / FSDP: each slice's state has one owner (its server), so it is consistent by
        construction and nothing moves. DDP overrides this with a broadcast from rank 0."""

    # -- torch's state dict, with the servers' moments --------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch's optimizer state dict: the param groups, and for strategies whose servers
        step (ZeRO, FSDP, hybrid) each parameter's state read from the servers, whole tensors
        as a plain torch optimizer on the unsharded model would hold them (FSDP users know
        this as ``FSDP.optim_state_dict``). Collective for ZeRO/FSDP: every rank calls it."""
        sd = self.inner.state_dict()
        read = getattr(self.model, "optimizer_state", None)
        if read is None:  # DDP: the trainer's own optimizer holds the state
            return sd
        states = read()
        sd["state"] = {
            index: states[id(p)]
            for group, saved in zip(self.inner.param_groups, sd["param_groups"], strict=True)
            for p, index in zip(group["params"], saved["params"], strict=True)
            if id(p) in states
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Loads what ``state_dict`` gave (here or from a plain torch optimizer over the same
        parameters): hyper-parameters into the param groups, moments into the servers."""
        write = getattr(self.model, "load_optimizer_state", None)
        if write is None:
            self.inner.load_state_dict(state_dict)
        else:
            groups = state_dict["param_groups"]
            self.inner.load_state_dict({"state": {}, "param_groups": groups})
            by_index = {
                index: p
                for group, saved in zip(self.inner.param_groups, groups, strict=True)
                for p, index in zip(group["params"], saved["params"], strict=True)
            }
            write({id(by_index[i]): st for i, st in state_dict["state"].items()})
        # torch's load makes new group dicts: share them again, so schedulers drive both
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def serialize(self) -> bytes:
        """Options and ``state_dict()`` (torch.save bytes): hyper-parameters and every
        parameter's optimizer state, read from the servers for ZeRO / FSDP / hybrid."""
        buf = io.BytesIO()
        torch.save(
            {
                "options": self.get_options(),
                "state_dict": self.state_dict(),
                "validation_losses": self._validation_losses,
            },
            buf,
        )
        return buf.getvalue()

    def deserialize(self, data: bytes) -> None:
        try:
            saved = torch.load(io.BytesIO(bytes(data)), weights_only=False)
            state_dict = saved["state_dict"]
        except Exception as exc:
            raise ValueError(f"deserialize: not a serialized optimizer ({exc})") from None
        self.load_state_dict(state_dict)
        self._validation_losses = list(saved.get("validation_losses", []))

    def save_model(self, path: str | os.PathLike) -> None:
        write_bytes(path, self.serialize())

    def load_model(self, path: str | os.PathLike) -> None:
        self.deserialize(read_bytes(path, "load_model", "optimizer"))


class DDPOptimizer(ShardedOptimizer):
    """Steps the wrapped torch optimizer locally on the averaged gradients."""

    def synchronize_optimizer_state(self) -> None:
        """Makes every rank's optimizer state equal rank 0's (broadcast, tensor by tensor)."""
        client = self.model.client
        for group in self.param_groups:
            for p in group["params"]:
                for _, value in sorted(self.state.get(p, {}).items()):
                    if torch.is_tensor(value):
                        value.copy_(client.broadcast(value, src=0))


class ZeRO1Optimizer(ShardedOptimizer):
    """Optimizer state and fp32 master sharded on the servers (ZeRO stage 1)."""


class ZeRO2Optimizer(ShardedOptimizer):
    """As ZeRO-1; gradients already reduce-scattered during backward (ZeRO stage 2)."""


class FSDPOptimizer(ShardedOptimizer):
    """Optimizer for FSDPModel: the servers step their slices (ZeRO stage 3)."""


ZeRO3Optimizer = FSDPOptimizer
