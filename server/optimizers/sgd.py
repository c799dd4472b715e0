"""torch.optim.SGD (momentum, dampening, Nesterov, weight decay, maximize)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paramshard.server.optimizers.base import ServerOptimizer
from paramshard.server.optimizers.kernels import add_scaled, scalar
from paramshard.server.runtime import backend


class SGD(ServerOptimizer):
    """torch.optim.SGD (``_single_tensor_sgd``).

    The momentum buffer is absent until the first step with momentum != 0, which seeds it
    with a copy of the (decayed) gradient without dampening, exactly as torch does.
    """

    name = "sgd"
    defaults = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "nesterov": 0.0}
    defaults |= {"weight_decay": 0.0, "maximize": 0.0}
    flags = frozenset({"nesterov", "maximize"})
    state_names = ("momentum_buffer",)

    def _check(self, h: dict[str, float]) -> None:
        self._nonneg(h, "lr", "momentum", "weight_decay")
        if h["nesterov"] and (h["momentum"] <= 0 or h["dampening"] != 0):
            raise self._error(
                "nesterov", h["nesterov"], "Nesterov momentum requires momentum > 0 and dampening 0"
            )

    def _usable_state(self, h: Mapping[str, float]) -> tuple[str, ...]:
        return ("momentum_buffer",) if h["momentum"] != 0 else ()

    _seeding = False  # this step creates the momentum buffer: each block copies its gradient

    def _before_update(self, grad: Any, h: Mapping[str, float]) -> None:
        if h["momentum"] != 0 and "momentum_buffer" not in self._state:
            self._state["momentum_buffer"] = backend.xp.empty_like(grad)
            self._seeding = True

    def _after_update(self) -> None:
        self._seeding = False

    def _update(self, param: Any, grad: Any, state: dict[str, Any], h: Mapping[str, float]) -> None:
        if h["weight_decay"] != 0:
            add_scaled(grad, param, h["weight_decay"])
        momentum = h["momentum"]
        if momentum != 0:
            buf = state["momentum_buffer"]
            if self._seeding:
                buf[...] = grad
            else:
                buf *= scalar(momentum, buf)
                add_scaled(buf, grad, 1 - h["dampening"])
            if h["nesterov"]:
                add_scaled(grad, buf, momentum)
            else:
                grad = buf
        add_scaled(param, grad, -h["lr"])
