"""What ZeRO-1, ZeRO-2 and FSDP share: optimizer state and master copy on the servers.

Each (unit, param group) is a flat buffer registered on every server with the torch optimizer's
type and that group's hyper-parameters; server i owns slice i and runs the optimizer there
(ZeRO, arXiv 1910.02054). The master copy is float64 for float64 parameters and float32 for
the rest (``BufferSpec.master_dtype``); gradients travel in ``config.reduce_dtype_for`` and
parameters come back in ``config.param_dtype_for`` of each buffer. One training step is:

1. gradients pushed (how and when is the strategy's business) for step ``_step``;
2. each server reports its slices' sum of squares and whether they are finite (GradNorm, once
   per step): ``clip_grad_norm_`` computes the global norm and clip coefficient from it, and
   the step is skipped on every server when any slice holds NaN or Inf (strategies/nonfinite.py);
3. ``optimizer.step()``: one Step request per server carrying each buffer's current
   hyper-parameters (so torch LR schedulers drive the servers) and the clip coefficient;
4. parameters pulled at version ``_step + 1`` (ZeRO: right away; FSDP: unit by unit, later).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from client import GradCheck, StepArgs, restarts
from protos.manifest import ParamSplit
from strategies.base import ShardedModelBase, hf_model_config
from strategies.config import ShardingConfiguration
from strategies.device import Landing, Outgoing, device_of, to_host
from strategies.layout import (
    BufferSpec,
    flatten,
    norm_tensor,
    plan_buffers,
    plan_units,
    torch_dtype,
)
from strategies.mixed_precision import gather_dtype
from strategies.nonfinite import settle

__all__ = ["ServerShardedModel", "server_optimizer", "server_hyper"]

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


def server_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """The server-side name of a torch optimizer, or a clear error."""
    for cls, name in _SERVER_OPTIMIZERS.items():
        if type(optimizer) is cls:
            if name == "adam" and optimizer.defaults.get("decoupled_weight_decay"):
                return "adamw"
            return name
    supported = ", ".join(c.__name__ for c in _SERVER_OPTIMIZERS)
    raise TypeError(
        f"{type(optimizer).__name__} does not run on the shard servers; supported: {supported}"
    )


def server_hyper(name: str, group: dict[str, Any]) -> dict[str, float]:
    """A torch param group's hyper-parameters under the servers' names (betas split)."""
    out = {k: float(group[k]) for k in _HYPER[name] if k in group}
    if "betas" in group:
        out["beta1"], out["beta2"] = (float(b) for b in group["betas"])
    return out


class ServerShardedModel(ShardedModelBase):
    """Base of the strategies whose optimizer runs on the servers."""

    state_on_servers = True

    def __init__(
        self,
        model: nn.Module,
        config: ShardingConfiguration,
        wrap: tuple[type[nn.Module], ...] | None = None,
    ) -> None:
        super().__init__(model, config)
        self._units = plan_units(
            model,
            wrap,
            config.wrap_min_params,
            min_unit_params=config.minimum_parameter_group_size
            if wrap or config.wrap_min_params
            else 0,
        )
        self._buffers: list[BufferSpec] = []
        self._opt_name = ""
        self._step = 0  # optimizer steps applied: the servers' version
        self._micro = 0  # backward passes since the last step
        self._clip_coef = 1.0
        self._inv_scale = 1.0  # 1 / a loss scaler's scale, once unscaled (grad_scaler.py)
        self._check: GradCheck | None = None  # this step's GradNorm, once gathered
        self.agree_on_finite: Any = None
        """Set by a wrapper whose model spans several jobs (3D: one per stage and tensor rank):
        ``agree_on_finite(where)`` widens where this job's gradient is not finite to the whole
        model, the same on every rank (strategies/nonfinite.py ``across_parts``)."""
        self.param_splits: dict[str, dict[str, int]] = {}
        """Parameter name -> ``split_*`` fields (``ParamSplit``), for parameters that are one
        tensor-parallel part of a larger tensor (set by HybridShardedModel before attaching);
        they go into the servers' manifests so export can put the whole tensor together."""
        self.model_config = hf_model_config(model)
        """The model's description the servers record for export (``hf_model_config``: a
        Hugging Face model's class and config; "" for others); a wrapper of a part of a model
        sets the whole model's before attaching."""
        self._pending: list[Future] = []
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="push")

    @property
    def registered(self) -> bool:
        return bool(self._buffers)

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far, applied or skipped (the servers' version of every
        buffer; a step skipped for a non-finite gradient counts, see ``skipped_steps``)."""
        return self._step

    # -- registration --------------------------------------------------------------------
    def _attach(self, optimizer: Any) -> None:
        inner = optimizer.inner
        self._opt_name = server_optimizer(inner)  # before attaching: a rejected one stays out
        super()._attach(optimizer)
        buffers = plan_buffers(self.module, self._units, inner.param_groups)
        job, versions, initialized = self.config.job, set(), True
        names: dict[int, list[str]] = {}  # tied weights: every name a parameter has
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        for i, b in enumerate(buffers):
            hyper = server_hyper(self._opt_name, inner.param_groups[b.group_index])
            replies = self.client.register_buffer(
                job,
                b.name,
                b.numel,
                optimizer=self._opt_name,
                hyper=hyper,
                params=[
                    replace(
                        e,
                        aliases=tuple(n for n in names[id(p)] if n != e.name),
                        split=ParamSplit.from_fields(self.param_splits.get(e.name, {})),
                    )
                    for e, p in zip(b.entries, b.params, strict=True)
                ],
                master_dtype=b.master_dtype,
                arrival_order=not self.config.deterministic,
                model_config=self.model_config if i == 0 else "",  # one copy per job
            )
            versions |= {r.version for r in replies}
            initialized &= all(r.initialized for r in replies)
        if len(versions) > 1 and restarts.restart_count() and max(versions) - min(versions) == 1:
            # A restarted rank arrived while a step was being applied (or its sender died
            # half-way): every server already holds that step's reduced gradient (see
            # _optimizer_step), so replaying it pushes duplicates and completes the step.
            versions = {min(versions)}
        if len(versions) > 1:
            raise RuntimeError(
                f"job '{job}' is on the servers at several versions {sorted(versions)}:"
                " restore a snapshot or drop the job"
            )
        self._buffers = buffers
        self._step = versions.pop() if initialized and versions else 0
        if not initialized and self.rank == 0:
            for b in buffers:  # rank 0's values are the starting point, as DDP broadcasts them
                # set_params writes float64 as float64
                flat = flatten(b.params, b.numel, torch_dtype(b.master_dtype))
                self.client.set_params(job, b.name, to_host(flat, flat.dtype), version=0)
        if self.config.replicate_every and self.rank == 0:
            from client import tools

            tools.configure_replication(self.client, job, self.config.replicate_every)
        self._after_register()

    def _after_register(self) -> None:
        """ZeRO: pull the servers' values into the replica; FSDP: free the local copy."""

    # -- pulling ------------------------------------------------------------------------------
    def _pull(
        self, buffers: list[BufferSpec], version: int, compute: bool = False
    ) -> dict[str, torch.Tensor]:
        """Each buffer's full values at ``version`` (waits for it), in its master dtype, or
        with ``compute`` in the dtype it computes in (``gather_dtype``: the servers cast, once
        per gather; strategies/mixed_precision.py)."""
        outs, calls = {}, []
        for b in buffers:
            dtype = gather_dtype(self.config, b) if compute else b.master_dtype
            landing = Landing(b.numel, dtype, device_of(b.params))
            calls += self.client.pull_calls(self.config.job, b.name, landing, version, dtype=dtype)
            outs[b.name] = (landing, torch_dtype(dtype))
        self.client.run(calls)
        return {name: landing.result(dtype) for name, (landing, dtype) in outs.items()}

    def _full_state(self) -> dict[str, torch.Tensor]:
        if not self.registered:
            return {n: p.detach().to(self._masters[n]).clone() for n, p in self._named}
        flats = self._pull(self._buffers, self._step)
        out = {}
        for b in self._buffers:
            for e in b.entries:
                out[e.name] = flats[b.name][e.offset : e.offset + e.numel].view(e.shape)
        return out

    def _load_full_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if not self.registered:
            with torch.no_grad():
                for n, p in self._named:
                    p.copy_(tensors[n])
            return
        for b in self._buffers:
            values = [tensors[e.name] for e in b.entries]
            flat = flatten(values, b.numel, torch_dtype(b.master_dtype))
            self.client.set_params(
                self.config.job, b.name, to_host(flat, flat.dtype), version=self._step
            )
        self._after_load()

    def _after_load(self) -> None:
        """ZeRO: refresh the replica from the servers; FSDP: nothing is held locally."""

    # -- pushing --------------------------------------------------------------------------
    def _push_async(self, b: BufferSpec, grads: torch.Tensor, start: int = 0) -> None:
        """Sends this micro-batch's gradient for [start, start + len) of buffer ``b``."""
        calls = self.client.push_calls(
            self.config.job,
            b.name,
            Outgoing(grads, torch_dtype(b.master_dtype)),
            self._step,
            micro=self._micro,
            num_micro=self._num_micro(),
            dtype=self.config.reduce_dtype_for(b.master_dtype),
            start=start,
            numel=b.numel,
        )
        self._pending.append(self._pool.submit(self.client.run, calls))

    def _num_micro(self) -> int:
        return 1

    def _wait_pushes(self) -> None:
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()

    def _ensure_reduced(self) -> None:
        """Every gradient of this step is on the servers (strategy-specific)."""
        raise NotImplementedError

    def _check_micro_count(self) -> None:
        """ZeRO-2 / FSDP pushed each backward as a micro-batch: as many as the servers wait for?"""
        want = self._num_micro()
        if self._micro != want:
            raise RuntimeError(
                f"{type(self).__name__}: {self._micro} backward passes since the last step,"
                f" but gradient_accumulation_steps={want} (the servers wait for that many)"
            )

    def synchronize_gradients(self) -> None:
        self._ensure_reduced()

    # -- clipping and stepping ------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips by the global 2-norm over all shards (as torch.nn.utils.clip_grad_norm_ on the
        whole model) and returns that norm. The servers scale their slices at the step."""
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_ supports the 2-norm only, got norm_type={norm_type}")
        if not self.registered:
            raise RuntimeError("clip_grad_norm_ needs an optimizer wrapper attached first")
        self._ensure_reduced()
        total = math.sqrt(sum(self._grad_check().sum_squares)) * self._inv_scale
        self._clip_coef = min(1.0, float(max_norm) / (total + 1e-6))
        return norm_tensor(total, (p.dtype for _, p in self._named))

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
            names = {b.name: len(b.entries) for b in self._buffers}
            params = names if per_param else None
            self._check = self.client.grad_check(self.config.job, list(names), self._step, params)
        return self._check

    def _optimizer_step(self) -> None:
        self._ensure_reduced()
        # Both phases of a step (server/nonfinite.py): every server's finiteness first, then
        # the same Step, applied or skipped, to all. Asking first also means no server moves
        # on while another still waits for a (restartable) dead rank's gradient.
        where = list(self._grad_check().nonfinite)
        if self.agree_on_finite is not None:
            where = self.agree_on_finite(where)
        groups = self.optimizer.param_groups
        args = {
            b.name: StepArgs(
                server_hyper(self._opt_name, groups[b.group_index]),
                self._clip_coef * self._inv_scale,  # the servers unscale as they clip
            )
            for b in self._buffers
        }
        step = self._step
        self.client.step(self.config.job, step, args, skip=bool(where))
        self._step += 1
        self._micro = 0
        self._clip_coef, self._inv_scale, self._check = 1.0, 1.0, None
        self._invalidate()
        self._after_step()
        if where:
            settle(self, self.config.job, step, where)

    def _after_step(self) -> None:
        """ZeRO: pull the new parameters into the replica; FSDP: gathered lazily."""

    # -- checkpoints (the servers' snapshots) -----------------------------------------------
    def save_checkpoint(self, tag: str) -> int:
        """Snapshot of this job on the servers (params, optimizer state, step) under ``tag``,
        in each server's --snapshot-dir. Every rank calls it at the same point; returns the
        version captured."""
        from client import tools

        self._ensure_idle()
        version = self._step
        if self.rank == 0:
            version = tools.snapshot(self.client, self.config.job, tag)["version"]
        self.client.barrier()
        return version

    def load_checkpoint(self, tag: str = "latest") -> int:
        """Restores snapshot ``tag`` into the servers (resharded if their number changed) and
        continues from its step. Every rank calls it at the same point; returns that step."""
        from client import tools

        if not self.registered:
            raise RuntimeError("load_checkpoint needs an optimizer wrapper attached first")
        self._ensure_idle()
        self.client.barrier()  # nobody still reads the old state when rank 0 replaces it
        if self.rank == 0:
            tools.restore(self.client, self.config.job, tag, contributors=self.world_size)
            if self.config.replicate_every:
                tools.configure_replication(
                    self.client, self.config.job, self.config.replicate_every
                )
        self.client.barrier()
        return self._adopt_server_version()

    def recover(self) -> int:
        """After a server died and came back: every server returns to the newest version they
        can all reach, from neighbour replicas when configured, else from the newest snapshot.
        Every rank calls it at the same point; returns the step to continue from."""
        from client import tools

        self._ensure_idle()
        self.client.barrier()  # every rank has dropped its half-done step
        if self.rank == 0:
            job = self.config.job
            try:
                if not self.config.replicate_every:
                    raise LookupError("replication is off")
                tools.recover_from_replicas(self.client, job)
            except LookupError:
                tools.restore(self.client, job, "latest", contributors=self.world_size)
            if self.config.replicate_every:
                tools.configure_replication(self.client, job, self.config.replicate_every)
        self.client.barrier()
        return self._adopt_server_version()

    def _adopt_server_version(self) -> int:
        from client import tools

        versions = {b.version for b in tools.job_params(self.client, self.config.job)}
        if len(versions) != 1:
            raise RuntimeError(f"after restore the job is at versions {sorted(versions)}")
        self._step = versions.pop()
        self._micro, self._clip_coef, self._inv_scale, self._check = 0, 1.0, 1.0, None
        self._invalidate()
        self._after_load()
        return self._step

    def restart_collectives(self, epoch: int) -> None:
        """After a failure left ranks at different collectives: numbering starts afresh in
        ``epoch`` (the same on every rank)."""
        self.client.restart_collectives(epoch)

    def abandon_step(self) -> None:
        """Drops a step that cannot finish (a server died): waits out pushes in flight,
        ignoring their errors, and forgets gradients pushed so far."""
        pending, self._pending = self._pending, []
        for fut in pending:
            try:
                fut.result()
            except Exception:  # noqa: BLE001, S110 - the step is being abandoned anyway
                pass
        self._micro, self._clip_coef, self._inv_scale, self._check = 0, 1.0, 1.0, None
        self._invalidate()
        self._abandon_local()

    def _abandon_local(self) -> None:
        """Strategy-specific local state of a half-done step (pushed flags, gathered units)."""

    def _ensure_idle(self) -> None:
        self._wait_pushes()
        if self._micro:
            raise RuntimeError(
                f"{type(self).__name__}: checkpoints are taken between steps; {self._micro}"
                " backward passes are waiting for optimizer.step()"
            )

    # -- optimizer state in torch's format ------------------------------------------------
    def optimizer_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """id(parameter) -> its optimizer state as torch keeps it ("step" and the moments,
        whole tensors), read from the servers at the current step; empty before the first
        step. What ``optimizer.state_dict()`` holds for a plain torch optimizer."""
        if not self.registered:
            return {}
        self._ensure_idle()
        info = self.client.optimizer_state_info(self.config.job)
        landings: dict[tuple[str, str], Landing] = {}
        calls = []
        for b in self._buffers:
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
        for b in self._buffers:
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
        self._ensure_idle()
        writes = []  # every rank checks (and fails) alike; rank 0 writes
        for b in self._buffers:
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
        if self.rank == 0:
            for name, key, flat, count in writes:
                self.client.set_params(
                    self.config.job,
                    name,
                    to_host(flat, flat.dtype),
                    version=self._step,
                    state=key,
                    optimizer_steps=count,
                )
        self.client.barrier()

    def get_model_metadata(self) -> dict[str, Any]:
        meta = super().get_model_metadata()
        meta.update(
            step=self._step,
            optimizer=self._opt_name,
            units=[name for name, _ in self._units],
            buffers={b.name: b.numel for b in self._buffers},
        )
        return meta
