"""The torch optimizer as the servers run it: its name and hyper-parameters on the servers, and
its state in torch's format (``optimizer.state_dict()``), read from and written to the
servers' slices."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from paramshard.strategies.device import Landing, device_of, to_host
from paramshard.strategies.layout import flatten, torch_dtype

if TYPE_CHECKING:
    from paramshard.client.carry import Carried

__all__ = ["TorchOptimizerState", "server_hyper", "server_optimizer"]

_SERVER_OPTIMIZERS = {
    torch.optim.SGD: "sgd",
    torch.optim.AdamW: "adamw",
    torch.optim.Adam: "adam",
    torch.optim.Adagrad: "adagrad",
    torch.optim.RMSprop: "rmsprop",
}
_HYPER = {
    "sgd": ("lr", "momentum", "dampening", "nesterov", "weight_decay", "maximize"),
    "adam": ("lr", "eps", "weight_decay", "amsgrad", "maximize"),
    "adamw": ("lr", "eps", "weight_decay", "amsgrad", "maximize"),
    "adagrad": ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value", "maximize"),
    "rmsprop": ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize"),
}


_KERNEL_OPTIONS = ("foreach", "fused", "capturable", "differentiable")
"""How torch runs an update on the trainer (which kernels, graphs, autograd): the servers run
it with their own arrays, so these change nothing there."""


def server_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """The server-side name of a torch optimizer, or a clear error. Warns when the optimizer
    asks for one of torch's kernel options (``fused=True``...), which the servers do not use."""
    for cls, name in _SERVER_OPTIMIZERS.items():
        if type(optimizer) is cls:
            _warn_kernel_options(optimizer)
            if name == "adam" and optimizer.defaults.get("decoupled_weight_decay"):
                return "adamw"
            return name
    supported = ", ".join(c.__name__ for c in _SERVER_OPTIMIZERS)
    raise TypeError(
        f"{type(optimizer).__name__} does not run on the shard servers; supported: {supported}"
    )


def _warn_kernel_options(optimizer: torch.optim.Optimizer) -> None:
    asked = sorted({k for g in optimizer.param_groups for k in _KERNEL_OPTIONS if g.get(k)})
    if asked:
        options = ", ".join(f"{k}=True" for k in asked)
        warnings.warn(
            f"{type(optimizer).__name__}({options}) is ignored: the shard servers run this"
            " optimizer's update by torch's single-tensor rules (foreach=False), on their own"
            " arrays (docs/training.md)",
            UserWarning,
            stacklevel=_callers_level(),
        )


def _callers_level() -> int:
    """The ``stacklevel`` that names the first line outside paramshard on the way to here: the
    user's that built the wrapper, however deep (a hybrid optimizer builds its ZeRO-1 one)."""
    level, frame = 1, sys._getframe(1)  # level 1: the function that warns
    while frame is not None and frame.f_globals.get("__name__", "").startswith("paramshard."):
        level, frame = level + 1, frame.f_back
    return level


def server_hyper(name: str, group: dict[str, Any]) -> dict[str, float]:
    """A torch param group's hyper-parameters under the servers' names (betas split)."""
    out = {k: float(group[k]) for k in _HYPER[name] if k in group}
    if "betas" in group:
        out["beta1"], out["beta2"] = (float(b) for b in group["betas"])
    return out


class TorchOptimizerState:
    """Mixed into ``ServerShardedModel``: the optimizer wrappers' ``state_dict()`` and
    ``load_state_dict()`` go through these."""

    def optimizer_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """id(parameter) -> its optimizer state as torch keeps it ("step" and the moments,
        whole tensors), read from the servers at the current step; empty before the first
        step. What ``optimizer.state_dict()`` holds for a plain torch optimizer."""
        if not self.registered:
            return {}
        self.ensure_idle()
        info = self.client.optimizer_state_info(self.config.job)
        landings: dict[tuple[str, str], Landing] = {}
        calls = []
        for b in self._flat_buffers:
            for key in info[b.name][0]:  # on the parameters' device, as torch keeps it
                landing = landings[b.name, key] = Landing(
                    b.numel, b.master_dtype, device_of(b.params)
                )
                calls += self.client.pull_calls(
                    self.config.job,
                    b.name,
                    landing,
                    self._step,
                    dtype=b.master_dtype,
                    state=key,
                )
        self.client.run(calls)
        flats = {k: landing.result(landing.tensor.dtype) for k, landing in landings.items()}
        out: dict[int, dict[str, torch.Tensor]] = {}
        for b in self._flat_buffers:
            keys, steps = info[b.name]
            if not keys:
                continue
            for e, p in zip(b.entries, b.params, strict=True):
                state: dict[str, torch.Tensor] = {}
                if self._opt_name != "sgd":  # torch's SGD keeps no step count
                    state["step"] = torch.tensor(float(steps))
                for key in keys:
                    flat = flats[b.name, key][e.offset : e.offset + e.numel]
                    state[key] = flat.view(e.shape).clone()
                out[id(p)] = state
        return out

    def load_optimizer_state(self, states: dict[int, dict[str, Any]]) -> None:
        """Writes torch-format optimizer state (id(parameter) -> "step" and moments, whole
        tensors) into the servers' slices; a parameter without state gets zeros, as before
        torch's first step. Every rank calls it with the same state (rank 0 writes)."""
        if not self.registered:
            raise RuntimeError("load_optimizer_state needs the optimizer wrapper attached first")
        self.ensure_idle()
        writes = []  # every rank checks (and fails) alike; rank 0 writes
        for b in self._flat_buffers:
            present = [states.get(id(p), {}) for p in b.params]
            keys = sorted({k for st in present for k in st if k != "step"})
            steps = {int(float(st["step"])) for st in present if "step" in st}
            if len(steps) > 1:
                raise ValueError(
                    f"load_optimizer_state: parameters of buffer '{b.name}' are at different"
                    f" optimizer steps {sorted(steps)}; the servers step a buffer as one"
                )
            count = steps.pop() if steps else (self._step if keys else 0)
            for key in keys:
                flat = torch.zeros(b.numel, dtype=torch_dtype(b.master_dtype))
                for e, st in zip(b.entries, present, strict=True):
                    value = st.get(key)
                    if value is None:
                        continue
                    if tuple(value.shape) != tuple(e.shape):
                        raise ValueError(
                            f"load_optimizer_state: state '{key}' of '{e.name}' has shape"
                            f" {list(value.shape)}, the parameter {list(e.shape)}"
                        )
                    flat[e.offset : e.offset + e.numel] = value.detach().reshape(-1)
                writes.append((b.name, key, flat, count))
        members = self.step_members  # elastic: the step's members, not the world
        if self.rank == members[0]:
            for name, key, flat, count in writes:
                self.client.set_params(
                    self.config.job,
                    name,
                    to_host(flat, flat.dtype),
                    version=self._step,
                    state=key,
                    optimizer_steps=count,
                )
        self.step_group().barrier()

    def prepare_carried(self, carried: Carried) -> Callable[[], None]:
        """Another layout's parameters and optimizer state (client/carry.py): this job's part
        of each (``param_splits``) as the snapshot's version with the optimizer at its step.
        Checks that the snapshot fits (RuntimeError naming what does not) and reads, on the
        first rank of the job's step, every buffer's values; returns their writing (the
        other ranks write nothing). ``restore_or_carry`` runs it once every rank prepared."""
        splits = self.param_splits
        shapes = {e.name: e.shape for b in self._flat_buffers for e in b.entries}
        wrong = carried.misfits(shapes, splits)
        same = {carried.optimizer, self._opt_name} <= {"adam", "adamw"}  # torch's alike too
        if carried.states and carried.optimizer != self._opt_name and not same:
            wrong.append(
                f"its optimizer state is {carried.optimizer}'s, this model's optimizer is"
                f" {self._opt_name}"
            )
        if wrong:
            raise RuntimeError(
                "load_checkpoint: the snapshot does not fit this model: " + "; ".join(wrong)
            )
        writes = []  # (buffer, state key or "" for the parameters, values)
        if self.rank == self.step_members[0]:
            held = self.client.optimizer_state_info(self.config.job)
            for b in self._flat_buffers:
                dtype = torch_dtype(b.master_dtype)
                # the parameters first (a new version), then every state array: the
                # snapshot's, and zeros for one this job made that the snapshot has not
                for key in ("", *sorted(set(carried.states) | set(held[b.name][0]))):
                    if key and key not in carried.states:
                        flat = torch.zeros(b.numel, dtype=dtype)
                    else:
                        parts = [
                            torch.from_numpy(carried.part(e.name, key, splits.get(e.name)))
                            for e in b.entries
                        ]
                        flat = flatten(parts, b.numel, dtype)
                    writes.append((b.name, key, to_host(flat, flat.dtype)))

        def write() -> None:
            self._step = carried.version  # the values are written as the snapshot's version
            for name, key, values in writes:
                self.client.set_params(
                    self.config.job,
                    name,
                    values,
                    version=self._step,
                    state=key,
                    optimizer_steps=carried.steps if key else 0,
                )

        return write
