"""The first phase of a step: what every server says of its reduced gradient slice.

A step is applied on all of a job's servers or on none (server/buffers/nonfinite.py): ``GradNorm``
tells each slice's sum of squares and whether it is finite, and the client sends every server
the same ``Step``, applied or skipped, as ``torch.amp.GradScaler`` steps or skips on
``found_inf``. ``GradCheck`` is that gathered answer; ``NonFiniteGradientError`` is what a
trainer raises when a step was skipped for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GradCheck", "NonFiniteGradientError"]


@dataclass(frozen=True)
class GradCheck:
    """Every server's ``GradNorm`` of step ``step`` of job ``job``."""

    job: str
    step: int
    buffers: tuple[str, ...]
    """The buffers asked about, in request order."""
    sum_squares: tuple[float, ...]
    """Per buffer, the sum of squares of its reduced gradient over all servers."""
    nonfinite: tuple[str, ...]
    """Each slice holding NaN or Inf, as "buffer 'b' on server i (host:port)"; empty: the
    whole gradient is finite and the step may be applied."""
    param_sum_squares: dict[str, list[float]] | None = None
    """When asked for: per buffer, each registered parameter's sum of squares over all
    servers, in registration order."""

    @property
    def finite(self) -> bool:
        return not self.nonfinite

    @classmethod
    def from_replies(
        cls,
        job: str,
        step: int,
        buffers: Sequence[str],
        replies: Sequence[Any],
        servers: Sequence[int],
        addresses: Sequence[str],
        params: Mapping[str, int] | None = None,
    ) -> GradCheck:
        """From the ``GradNormReply`` of each server (``servers``: their indices in the whole
        cluster, ``addresses``: where they listen, both in reply order; ``params``: buffer ->
        its parameter count, when per-parameter sums were asked for)."""
        nonfinite = []
        want = sum(params.values()) if params is not None else 0
        for r, server, address in zip(replies, servers, addresses, strict=True):
            got = (len(r.finite), len(r.param_sum_squares))
            if got != (len(buffers), want):
                raise RuntimeError(
                    f"server {server} ({address}) GradNorm for job '{job}' reported finiteness"
                    f" of {got[0]} buffers and {got[1]} per-parameter sums, expected"
                    f" {len(buffers)} and {want}: a server older than this client?"
                )
            nonfinite += [
                f"buffer '{name}' on server {server} ({address})"
                for name, ok in zip(buffers, r.finite, strict=True)
                if not ok
            ]
        sums = tuple(float(sum(r.sum_squares[k] for r in replies)) for k in range(len(buffers)))
        per_param = None
        if params is not None:
            totals = np.sum([np.asarray(r.param_sum_squares, np.float64) for r in replies], 0)
            per_param, start = {}, 0
            for name in buffers:
                per_param[name] = totals[start : start + params[name]].tolist()
                start += params[name]
        return cls(job, step, tuple(buffers), sums, tuple(nonfinite), per_param)


class NonFiniteGradientError(RuntimeError):
    """Step ``step`` of job ``job`` had a reduced gradient holding NaN or Inf (``where``), so
    it was skipped on every server: parameters and optimizer state are as before the step."""

    def __init__(self, job: str, step: int | None, where: Sequence[str], hint: str = "") -> None:
        self.job, self.step, self.where = job, step, tuple(where)
        at = f", step {step}" if step is not None else ""
        super().__init__(
            f"job '{job}'{at}: the gradient is not finite (NaN or Inf) in {'; '.join(where)};"
            " the step was skipped everywhere (parameters and optimizer state unchanged)"
            + (f". {hint}" if hint else "")
        )
