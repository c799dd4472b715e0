"""A server-sharded model's gradient clipping and a loss scaler's unscale: the global 2-norm
from every server's sum of squares of its slices (``GradNorm``, once per step, with the step's
finiteness), and the clip coefficient the servers apply at the step.

A wrapper whose model spans several jobs (3D hybrid, strategies/hybrid.py) sums the norm over
all of them: it reads this job's sums with ``reduced_grad_check`` and ``param_sums``, adds the
other jobs' in one all-reduce, and sets the coefficient with ``clip_by``."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from paramshard.client import GradCheck
from paramshard.strategies.layout import norm_tensor

__all__ = ["ServerClipping"]


class ServerClipping:
    """Mixed into ``ServerShardedModel`` (strategies/data_parallel/sharded.py), which holds the
    state read here: the step's buffers, its clip coefficient and loss scale, and its check."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips by the global 2-norm over all shards (as torch.nn.utils.clip_grad_norm_ on the
        whole model) and returns that norm. The servers scale their slices at the step."""
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_ supports the 2-norm only, got norm_type={norm_type}")
        if not self.registered:
            raise RuntimeError("clip_grad_norm_ needs an optimizer wrapper attached first")
        total = self.clip_by(sum(self.reduced_grad_check().sum_squares), max_norm)
        return norm_tensor(total, (p.dtype for _, p in self._named))

    def reduced_grad_check(self, per_param: bool = False) -> GradCheck:
        """Every server's sum of squares and finiteness of this step's reduced gradient (waits
        until every gradient of the step is on the servers), asked once a step; ``per_param``:
        with each parameter's sum of squares too (``param_sums``). Its sums are of the
        gradients as reduced, before a loss scaler's unscale."""
        self._ensure_reduced()
        return self._grad_check(per_param)

    def param_sums(self, check: GradCheck) -> Iterator[tuple[str, nn.Parameter, float]]:
        """(name, parameter, sum of squares) of each parameter of this job, from ``check``
        (``reduced_grad_check(per_param=True)``)."""
        sums = check.param_sum_squares or {}
        for b in self._flat_buffers:
            for e, p, sq in zip(b.entries, b.params, sums[b.name], strict=True):
                yield e.name, p, sq

    def clip_by(self, sum_squares: float, max_norm: float) -> float:
        """Sets this step's clip coefficient from the global ``sum_squares`` of the reduced
        gradients and returns the norm, unscaled as a loss scaler's ``unscale_`` asked."""
        total = math.sqrt(sum_squares) * self._inv_scale
        self._clip_coef = min(1.0, float(max_norm) / (total + 1e-6))
        return total

    def _unscale_grads(self, inv_scale: float) -> None:
        """A loss scaler's ``unscale_``: the servers' reduced gradients are ``1 / inv_scale``
        times the true ones, so clipping's norm is multiplied by ``inv_scale`` and the servers
        multiply their slices by it at the step, folded into the clip coefficient."""
        self._ensure_reduced()
        self._inv_scale = float(inv_scale)

    def _grad_check(self, per_param: bool = False) -> GradCheck:
        """Every server's GradNorm of this step (waits for the reduced gradient), gathered once
        for clipping and the step; ``per_param``: with each parameter's sum of squares."""
        if self._check is None or (per_param and self._check.param_sum_squares is None):
            names = {b.name: len(b.entries) for b in self._flat_buffers}
            params = names if per_param else None
            self._check = self.client.grad_check(
                self.config.job, list(names), self._step, params, generation=self._generation()
            )
        return self._check
