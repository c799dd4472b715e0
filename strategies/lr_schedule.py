"""Keeping a torch LR scheduler at the servers' step: after a recovery replays steps, or when a
rank joins an elastic job at step s, its schedule must say what it says at step s.

``sync_scheduler(scheduler, step)`` steps the scheduler forward to ``step``, or, when it is
past it (a recovery went back), from its start again. It suits the schedulers whose learning
rate is a function of the step count (``LambdaLR``, ``CosineAnnealingLR``, ``StepLR``,
``OneCycleLR``, ...), not ``ReduceLROnPlateau``, which follows a metric.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["sync_scheduler"]


def sync_scheduler(scheduler: Any, step: int) -> None:
    """Makes ``scheduler.last_epoch == step`` (the learning rates of step ``step``)."""
    if scheduler is None or scheduler.last_epoch == step:
        return
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose
        warnings.simplefilter("ignore", UserWarning)
        if scheduler.last_epoch > step:  # back to its start: learning rates as built
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
                group["lr"] = lr
            scheduler.last_epoch = 0
        while scheduler.last_epoch < step:
            scheduler.step()
