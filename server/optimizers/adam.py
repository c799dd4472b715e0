"""torch.optim.Adam and AdamW (L2 or decoupled weight decay, AMSGrad, maximize)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from paramshard.server.optimizers.base import ServerOptimizer
from paramshard.server.optimizers.kernels import add_scaled, addcdiv, addcmul_sq, lerp, scalar
from paramshard.server.runtime import backend


class Adam(ServerOptimizer):
    """torch.optim.Adam (``_single_tensor_adam``, non-capturable branch).

    Bias corrections and step size are Python doubles as in torch; only the values passed
    to kernels (step_size, sqrt of bias correction 2, eps, betas) are rounded to the shard's
    dtype (float32 rounds them; float64 keeps them).
    """

    name = "adam"
    defaults = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    defaults |= {"amsgrad": 0.0, "maximize": 0.0}
    flags = frozenset({"amsgrad", "maximize"})
    state_names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    decoupled_weight_decay: ClassVar[bool] = False

    def _check(self, h: dict[str, float]) -> None:
        self._nonneg(h, "lr", "eps", "weight_decay")
        for key in ("beta1", "beta2"):
            if not 0.0 <= h[key] < 1.0:
                raise self._error(key, h[key], "must satisfy 0 <= beta < 1")

    def _required_state(self, h: Mapping[str, float]) -> tuple[str, ...]:
        return self.state_names if h["amsgrad"] else self.state_names[:2]

    def _update(self, param: Any, grad: Any, state: dict[str, Any], h: Mapping[str, float]) -> None:
        xp = backend.xp
        lr, beta1, beta2 = h["lr"], h["beta1"], h["beta2"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if h["weight_decay"] != 0:
            if self.decoupled_weight_decay:
                param *= scalar(1 - lr * h["weight_decay"], param)
            else:
                add_scaled(grad, param, h["weight_decay"])
        lerp(exp_avg, grad, 1 - beta1)
        exp_avg_sq *= scalar(beta2, exp_avg_sq)
        addcmul_sq(exp_avg_sq, grad, 1 - beta2)

        step = float(self.step_count)  # torch keeps step as a float32 tensor, read via .item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5

        second = exp_avg_sq
        if h["amsgrad"]:
            second = state["max_exp_avg_sq"]
            xp.maximum(second, exp_avg_sq, out=second)
        denom = xp.sqrt(second)
        denom /= scalar(bias_correction2_sqrt, denom)
        denom += scalar(h["eps"], denom)
        addcdiv(param, exp_avg, denom, -step_size)


class AdamW(Adam):
    """torch.optim.AdamW: in torch 2.13 literally Adam with ``decoupled_weight_decay=True``."""

    name = "adamw"
    defaults = {**Adam.defaults, "weight_decay": 1e-2}
    decoupled_weight_decay = True
