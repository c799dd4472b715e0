"""Loss scaling for float16 compute: ``ShardedGradScaler``, torch's ``GradScaler`` over the servers.

float16 holds nothing below ~6e-8 and nothing above 65504, so small gradients underflow to
zero. Loss scaling (Micikevicius et al., "Mixed Precision Training", arXiv 1710.03740, §3.2)
multiplies the loss by a scale S before backward, so every gradient is S times larger, and
divides by S before the step. When S is too large some gradient overflows to Inf: that step is
skipped and S shrinks (``backoff_factor``); after ``growth_interval`` good steps S grows.

The usage is torch's (``torch.amp.GradScaler``, FSDP's ``ShardedGradScaler``)::

    scaler = ShardedGradScaler()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)                    # optional: before clipping
    model.clip_grad_norm_(1.0)
    scaler.step(opt)                        # skipped if any gradient is not finite
    scaler.update()

What differs is where things happen. ``found_inf`` is the global non-finite decision the
strategies make anyway (strategies/nonfinite.py): for ZeRO and FSDP every server reports whether
its reduced slice is finite (``GradNorm``) and all get the same ``Step``, applied or skipped;
DDP's averaged gradients are the same on every rank. ``unscale_`` does not touch gradients on
the servers: clipping's norm is divided by S, and the servers multiply their slices by 1/S as
part of the clip coefficient in the ``Step`` request. A skipped step is counted in
``model.skipped_steps`` and never raises, whatever ``ShardingConfiguration.skip_nonfinite`` says.

An elastic job (strategies/data_parallel/elastic.py): a rank that joins brings a scaler of its
own, whose scale may differ from the others', and the servers would sum gradients scaled
differently. So ``step`` first compares the step's members' scalers (one small all-gather over
the step's members): when their scales differ, the step is skipped everywhere, as for an
overflow, and every member takes the state of the scaler that has seen the most steps (then
backs off, as after any skipped step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from paramshard.strategies.nonfinite import NonFiniteGradientError

__all__ = ["ShardedGradScaler"]

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


class ShardedGradScaler:
    """Dynamic loss scaling for a sharded model's optimizer wrapper (torch's ``GradScaler``
    arguments and methods; ``enabled=False`` makes every method a pass-through)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        checks = {
            "init_scale": (init_scale, float(init_scale) > 0, "> 0"),
            "growth_factor": (growth_factor, float(growth_factor) > 1, "> 1"),
            "backoff_factor": (backoff_factor, 0 < float(backoff_factor) < 1, "in (0, 1)"),
        }
        for name, (value, ok, want) in checks.items():
            if not ok:
                raise ValueError(f"ShardedGradScaler: {name} must be {want}, got {value!r}")
        if (
            isinstance(growth_interval, bool)
            or not isinstance(growth_interval, int)
            or growth_interval < 1
        ):
            raise ValueError(
                f"ShardedGradScaler: growth_interval must be an int >= 1, got {growth_interval!r}"
            )
        self._enabled = bool(enabled)
        self._scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._growth_tracker = 0
        self._updates = 0  # update() calls: the scaler that saw most leads an elastic job's
        self._states: dict[int, str] = {}  # id(optimizer) -> where it is in this iteration
        self._found_inf: bool | None = None

    # -- the iteration ---------------------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or nested lists / tuples / dicts of them) times the scale."""
        if not self._enabled:
            return outputs

        def times(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x * self._scale
            raise TypeError(f"ShardedGradScaler.scale: expected tensors, got {type(x).__name__}")

        return tree_map(times, outputs)

    def unscale_(self, optimizer: Any) -> None:
        """Divides this step's gradients by the scale (for ZeRO / FSDP: clipping and the
        servers' step will), so ``clip_grad_norm_`` sees the true norm. At most once per
        optimizer between ``update`` calls, and before ``step``."""
        if not self._enabled:
            return
        state = self._states.get(id(optimizer), _READY)
        if state == _UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        _model_of(optimizer)._unscale_grads(1.0 / self._scale)
        self._states[id(optimizer)] = _UNSCALED

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` (unscaling first if ``unscale_`` was not called) unless a
        gradient is not finite anywhere; then the step is skipped on every rank and server
        and None is returned."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or args:
            raise RuntimeError("ShardedGradScaler.step does not support a closure.")
        state = self._states.get(id(optimizer), _READY)
        if state == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state == _READY:
            self.unscale_(optimizer)
        model = _model_of(optimizer)
        if getattr(model, "elastic", False):
            self._agree(model)
        before = model.skipped_steps
        try:
            result = optimizer.step()
            found = model.skipped_steps > before
        except NonFiniteGradientError:  # skipped everywhere, and expected here: no error
            result, found = None, True
        self._found_inf = bool(self._found_inf) or found
        self._states[id(optimizer)] = _STEPPED
        return None if found else result

    def _agree(self, model: Any) -> None:
        """Elastic: the step's members compare scalers; differing scales skip the step and
        every member takes the state of the one that saw the most steps (module docstring)."""
        mine = torch.tensor([self._updates, self._scale, self._growth_tracker], dtype=torch.float64)
        states = model.step_group().all_gather(mine)
        if len({float(s[1]) for s in states}) == 1:
            return
        best = max(states, key=lambda s: float(s[0]))  # the first of the most experienced
        scales = sorted({float(s[1]) for s in states})
        model.skip_step(f"the loss scales of the step's members differ ({scales})")
        self._updates, self._scale = int(best[0]), float(best[1])
        self._growth_tracker = int(best[2])

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Ends the iteration: the scale backs off if a step was skipped, grows after
        ``growth_interval`` steps in a row that were not; ``new_scale`` sets it instead."""
        if not self._enabled:
            return
        if new_scale is not None:
            value = float(new_scale)
            if not value > 0:
                raise ValueError(f"ShardedGradScaler.update: new_scale must be > 0, got {value}")
            self._scale = value
        elif self._found_inf is None:
            raise RuntimeError("ShardedGradScaler.update: no step() since the last update")
        elif self._found_inf:
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker = 0
        self._states.clear()
        self._found_inf = None
        self._updates += 1

    # -- torch's accessors and state dict --------------------------------------------------------
    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int(new_interval)

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries (empty when disabled); take it after ``update``."""
        if not self._enabled:
            return {}
        return {
            "scale": self._scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError(
                "ShardedGradScaler.load_state_dict: the state dict is empty (saved by a"
                " disabled scaler?)"
            )
        self._scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])


def _model_of(optimizer: Any) -> Any:
    model = getattr(optimizer, "model", None)
    if model is None or not hasattr(model, "_unscale_grads"):
        raise TypeError(
            "ShardedGradScaler works with a paramshard optimizer wrapper (DDPOptimizer,"
            f" ZeRO1Optimizer, ..., FSDPOptimizer), got {type(optimizer).__name__}"
        )
    return model
