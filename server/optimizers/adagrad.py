"""torch.optim.Adagrad (lr decay, initial accumulator, weight decay, maximize)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paramshard.server.optimizers.base import ServerOptimizer
from paramshard.server.optimizers.kernels import add_scaled, addcdiv, addcmul_sq, scalar
from paramshard.server.runtime import backend


class Adagrad(ServerOptimizer):
    """torch.optim.Adagrad (``_single_tensor_adagrad``, dense gradients).

    Like torch, ``sum`` is allocated at construction filled with
    ``initial_accumulator_value``; changing that value later has no effect.
    """

    name = "adagrad"
    defaults = {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "eps": 1e-10}
    defaults |= {"initial_accumulator_value": 0.0, "maximize": 0.0}
    flags = frozenset({"maximize"})
    state_names = ("sum",)

    def _check(self, h: dict[str, float]) -> None:
        self._nonneg(h, "lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")

    def _required_state(self, h: Mapping[str, float]) -> tuple[str, ...]:
        return self.state_names

    def _initialized(self) -> bool:
        return True  # torch creates the state in Adagrad.__init__

    def _init_state(self) -> None:
        xp = backend.xp
        init = self.hyper["initial_accumulator_value"]
        self._state = {"sum": xp.full(self.numel, init, dtype=self.dtype)}

    def _update(self, param: Any, grad: Any, state: dict[str, Any], h: Mapping[str, float]) -> None:
        xp = backend.xp
        state_sum = state["sum"]
        if h["weight_decay"] != 0:
            add_scaled(grad, param, h["weight_decay"])
        step = float(self.step_count)
        clr = h["lr"] / (1 + (step - 1) * h["lr_decay"])
        addcmul_sq(state_sum, grad, 1.0)
        std = xp.sqrt(state_sum)
        std += scalar(h["eps"], std)
        addcdiv(param, grad, std, -clr)
