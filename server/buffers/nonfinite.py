"""Non-finite gradients never reach the master copy: a step is applied on all servers or none.

A job's reduced gradient is cut over its servers, so no server alone can tell whether the step
is sound. The decision takes two phases, as ``torch.amp.GradScaler`` does with ``found_inf``:

1. ``GradNorm``: each server reports, per buffer, its reduced slice's sum of squares (what
   global clipping already gathers) and whether the slice is finite;
2. ``Step``: the client that gathered every server's answer sends all of them the same
   decision: apply, or ``skip`` (every rank computes the same one from the same answers; the
   first request wins, as before); ``step_replies`` answers both calls.

A skipped step leaves parameters and optimizer state (its step count included) as they were and
still moves the version on, so a version counts steps *taken*: a trainer waiting for version
s + 1 is released, a pushed retry of step s stays a duplicate, and a restarted rank resumes its
data at the right batch. A server told to apply a slice that is not finite refuses the whole
request (FAILED_PRECONDITION) before stepping any of its buffers, so a client that skipped the
first phase cannot poison the model either. Torch-free, like the rest of ``server/``.
"""

from __future__ import annotations

import math
from typing import Any

from paramshard.server.runtime import backend

__all__ = ["all_finite", "nonfinite_refusal"]


def all_finite(values: Any, sum_squares: float) -> bool:
    """Whether every element of ``values`` is finite, given their sum of squares: a NaN or Inf
    element makes that sum NaN or Inf, so a finite sum proves it for free; only a sum that
    overflowed needs a pass of its own."""
    if math.isfinite(sum_squares):
        return True
    return bool(backend.xp.isfinite(values).all())


def nonfinite_refusal(label: str, step: int) -> str:
    """The FAILED_PRECONDITION message of a Step that would apply a non-finite slice."""
    return (
        f"{label}: the reduced gradient of step {step} holds NaN or Inf on this server, so it is"
        " not applied; gather GradNorm.finite from every server of the job and send them all a"
        " Step with skip=true to discard it"
    )
