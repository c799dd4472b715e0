"""The loss a strategy uses when the script sets no ``default_loss_function``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["default_loss"]


def default_loss(output: Any, target: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy for class targets (any number of leading dims), MSE for float targets.
    A ``ModelOutput`` gives its ``logits``; without a target, its own ``loss`` (the model was
    given ``labels=``)."""
    if target is None:
        loss = getattr(output, "loss", None)
        if loss is None:
            raise ValueError("no target y, and the model's output has no loss (pass labels=?)")
        return loss
    logits = getattr(output, "logits", output)
    if target.is_floating_point():
        return nn.functional.mse_loss(logits, target)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
