"""torch.optim.RMSprop (centered, momentum, weight decay, maximize)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paramshard.server.optimizers.base import ServerOptimizer
from paramshard.server.optimizers.kernels import add_scaled, addcdiv, addcmul_sq, lerp, scalar
from paramshard.server.runtime import backend


class RMSprop(ServerOptimizer):
    """torch.optim.RMSprop (``_single_tensor_rmsprop``).

    ``momentum_buffer`` exists only if momentum > 0 and ``grad_avg`` only if centered at
    the first step, as torch's ``_init_group`` decides.
    """

    name = "rmsprop"
    defaults = {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0}
    defaults |= {"centered": 0.0, "maximize": 0.0}
    flags = frozenset({"centered", "maximize"})
    state_names = ("square_avg", "momentum_buffer", "grad_avg")

    def _check(self, h: dict[str, float]) -> None:
        self._nonneg(h, "lr", "eps", "momentum", "weight_decay", "alpha")

    def _required_state(self, h: Mapping[str, float]) -> tuple[str, ...]:
        wanted = (True, h["momentum"] > 0, bool(h["centered"]))
        return tuple(n for n, want in zip(self.state_names, wanted, strict=True) if want)

    def _update(self, param: Any, grad: Any, state: dict[str, Any], h: Mapping[str, float]) -> None:
        xp = backend.xp
        alpha = h["alpha"]
        square_avg = state["square_avg"]
        if h["weight_decay"] != 0:
            add_scaled(grad, param, h["weight_decay"])
        square_avg *= scalar(alpha, square_avg)
        addcmul_sq(square_avg, grad, 1 - alpha)
        if h["centered"]:
            grad_avg = state["grad_avg"]
            lerp(grad_avg, grad, 1 - alpha)
            avg = square_avg.copy()  # square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
            addcmul_sq(avg, grad_avg, -1.0)
            xp.sqrt(avg, out=avg)
        else:
            avg = xp.sqrt(square_avg)
        avg += scalar(h["eps"], avg)
        if h["momentum"] > 0:
            buf = state["momentum_buffer"]
            buf *= scalar(h["momentum"], buf)
            addcdiv(buf, grad, avg, 1.0)
            add_scaled(param, buf, -h["lr"])
        else:
            addcdiv(param, grad, avg, -h["lr"])
