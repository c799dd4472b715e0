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

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from paramshard.client import GradCheck, StepArgs, restarts
from paramshard.protos.manifest import ParamSplit
from paramshard.strategies.base import ShardedModelBase, hf_model_config
from paramshard.strategies.config import ShardingConfiguration
from paramshard.strategies.data_parallel.checkpoints import ServerCheckpoints
from paramshard.strategies.data_parallel.clipping import ServerClipping
from paramshard.strategies.data_parallel.elastic import ElasticSteps
from paramshard.strategies.data_parallel.flat_pool import FlatPool
from paramshard.strategies.data_parallel.server_optim import (
    TorchOptimizerState,
    server_hyper,
    server_optimizer,
)
from paramshard.strategies.device import Landing, Outgoing, device_of, to_host
from paramshard.strategies.layout import (
    BufferSpec,
    flatten,
    plan_buffers,
    plan_units,
    torch_dtype,
)
from paramshard.strategies.mixed_precision import gather_dtype
from paramshard.strategies.nonfinite import settle

__all__ = ["ServerShardedModel", "server_optimizer", "server_hyper"]

log = logging.getLogger(__name__)


class ServerShardedModel(
    ServerCheckpoints, ServerClipping, TorchOptimizerState, ElasticSteps, ShardedModelBase
):
    """Base of the strategies whose optimizer runs on the servers."""

    state_on_servers = True

    def __init__(
        self,
        model: nn.Module,
        config: ShardingConfiguration,
        *,
        wrap: tuple[type[nn.Module], ...] | None = None,  # FSDP's units; ZeRO has none
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
        self._flat_buffers: list[BufferSpec] = []
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
        self._flats = FlatPool()  # pushed flats, reused (the strategy sets its bound)
        self._skip_reason = ""  # skip_step: this step is skipped everywhere, whatever its norm
        self._last_step: tuple[int, dict[str, StepArgs], bool] | None = None
        """The Step this rank sent last (step, arguments, skip): an elastic rank resends it to
        servers a failure left one step behind (strategies/data_parallel/elastic_checkpoints.py)."""
        self._init_elastic()

    @property
    def registered(self) -> bool:
        return bool(self._flat_buffers)

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
        job = self.config.job
        held, empty = self._register(buffers)
        rejoining = (
            restarts.restarted(self.client.run_state.took_over)
            or restarts.group_restarted()  # torchrun's: the first process may have left cleanly
            or self.config.elastic
        )
        if held and empty and max(held) > max(empty) and rejoining:
            held, empty = self._rebuilt(buffers, held, empty)  # a server restarted empty
        versions, initialized = held | empty, not empty
        if len(versions) > 1 and rejoining and max(versions) - min(versions) == 1:
            # A restarted rank arrived while a step was being applied (or its sender died
            # half-way): every server already holds that step's reduced gradient (see
            # _optimizer_step), so replaying it pushes duplicates and completes the step.
            versions = {min(versions)}
        if len(versions) > 1:
            raise RuntimeError(
                f"job '{job}' is on the servers at several versions {sorted(versions)}:"
                " restore a snapshot or drop the job"
                + (" (some hold no values: a server restarted empty)" if held and empty else "")
            )
        self._flat_buffers = buffers
        self._step = versions.pop() if initialized and versions else 0
        if self._step and self.rank == 0 and not rejoining:  # said: a script run again
            log.warning(
                "job '%s' is on the servers at step %d: it resumes there (model.step_count);"
                " a new job name starts afresh",
                job,
                self._step,
            )
        if not held:
            restarts.starts_anew(job, self.rank)
        if not initialized and self.rank == 0:
            for b in buffers:  # rank 0's values are the starting point, as DDP broadcasts them
                # set_params writes float64 as float64
                flat = self._initial_flat(b)
                self.client.set_params(job, b.name, to_host(flat, flat.dtype), version=0)
        if self.config.replicate_every and self.rank == 0:
            from paramshard.client import tools

            tools.configure_replication(self.client, job, self.config.replicate_every)
        self._catch_up()  # a rank new to a running job: in the run's epoch
        self._after_register()

    def _register(self, buffers: list[BufferSpec]) -> tuple[set[int], set[int]]:
        """Registers every buffer on its servers (a buffer there already is left as it is):
        the versions of the slices that hold values, and of those that hold none yet."""
        inner = self.optimizer.inner
        held: set[int] = set()
        empty: set[int] = set()
        names: dict[int, list[str]] = {}  # tied weights: every name a parameter has
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        for i, b in enumerate(buffers):
            hyper = server_hyper(self._opt_name, inner.param_groups[b.group_index])
            replies = self.client.register_buffer(
                self.config.job,
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
            for r in replies:
                (held if r.initialized else empty).add(r.version)
        return held, empty

    def _initial_flat(self, b: BufferSpec) -> torch.Tensor:
        """Buffer ``b``'s values as one flat tensor in its master dtype: what rank 0 sets on
        the servers when the job is new (ZeRO keeps it as its replica)."""
        return flatten(b.params, b.numel, torch_dtype(b.master_dtype))

    def _after_register(self) -> None:
        """ZeRO: pull the servers' values into the replica; FSDP: free the local copy."""

    # -- pulling ------------------------------------------------------------------------------
    def _pull(
        self,
        buffers: list[BufferSpec],
        version: int,
        compute: bool = False,
        into: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Each buffer's full values at ``version`` (waits for it), in its master dtype, or
        with ``compute`` in the dtype it computes in (``gather_dtype``: the servers cast, once
        per gather; strategies/mixed_precision.py). ``into``: buffer name -> a flat CPU
        tensor of that dtype to land in (the result is that tensor)."""
        outs, calls = {}, []
        into = into or {}
        for b in buffers:
            dtype = gather_dtype(self.config, b) if compute else b.master_dtype
            landing = Landing(b.numel, dtype, device_of(b.params), into.get(b.name))
            calls += self.client.pull_calls(self.config.job, b.name, landing, version, dtype=dtype)
            outs[b.name] = (landing, torch_dtype(dtype))
        self.client.run(calls)
        return {name: landing.result(dtype) for name, (landing, dtype) in outs.items()}

    def _full_state(self) -> dict[str, torch.Tensor]:
        if not self.registered:
            return {n: p.detach().to(self._masters[n]).clone() for n, p in self._named}
        flats = self._pull(self._flat_buffers, self._step)
        out = {}
        for b in self._flat_buffers:
            for e in b.entries:
                out[e.name] = flats[b.name][e.offset : e.offset + e.numel].view(e.shape)
        return out

    def _load_full_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if not self.registered:
            with torch.no_grad():
                for n, p in self._named:
                    p.copy_(tensors[n])
            return
        for b in self._flat_buffers:
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
        """Sends this micro-batch's gradient for [start, start + len) of buffer ``b``: a flat
        from ``self._flats``, which it goes back to once pushed."""
        if self._micro >= self._num_micro():  # the servers would refuse it, less clearly
            raise RuntimeError(
                f"{type(self).__name__}: backward pass {self._micro + 1} since the last step,"
                f" but gradient_accumulation_steps={self._num_micro()}: each backward's"
                " gradients go to the servers as one of that many micro-batches; to"
                " accumulate k backward passes a step, set"
                " ShardingConfiguration(gradient_accumulation_steps=k)"
            )
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
            membership=self._push_membership(),
        )
        self._pending.append(self._pool.submit(self._run_pushes, calls, grads))

    def _run_pushes(self, calls: list, flat: torch.Tensor) -> None:
        with self.comm_times.busy("push"):
            self.client.run(calls)
        self._flats.give(flat)

    def _num_micro(self) -> int:
        return 1

    def _wait_pushes(self) -> None:
        pending, self._pending = self._pending, []
        with self.comm_times.blocked("push"):
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

    # -- stepping ------------------------------------------------------------------------
    def _optimizer_step(self) -> None:
        self._ensure_reduced()
        # Both phases of a step (server/buffers/nonfinite.py): every server's finiteness first, then
        # the same Step, applied or skipped, to all. Asking first also means no server moves
        # on while another still waits for a (restartable) dead rank's gradient.
        with self.comm_times.blocked("grad_check"):
            where = list(self._grad_check().nonfinite)
        if self._skip_reason:
            where.append(self._skip_reason)
        if self.agree_on_finite is not None:
            where = self.agree_on_finite(where)
        groups = self.optimizer.param_groups
        args = {
            b.name: StepArgs(
                server_hyper(self._opt_name, groups[b.group_index]),
                self._clip_coef * self._inv_scale,  # the servers unscale as they clip
            )
            for b in self._flat_buffers
        }
        step = self._step
        self._last_step = (step, args, bool(where))
        with self.comm_times.blocked("step"):
            self.client.step(
                self.config.job, step, args, skip=bool(where), generation=self._generation()
            )
        self._step += 1
        self._micro, self._skip_reason = 0, ""
        if self.membership is not None:
            self.membership.training = None
        self._clip_coef, self._inv_scale, self._check = 1.0, 1.0, None
        self._invalidate()
        self._after_step()
        if where:
            settle(self, self.config.job, step, where)

    def _after_step(self) -> None:
        """ZeRO: pull the new parameters into the replica; FSDP: gathered lazily."""

    def skip_step(self, reason: str) -> None:
        """The coming ``optimizer.step()`` is skipped on every server, as for a gradient that
        is not finite (``reason`` says why; every rank of the step must call it alike)."""
        self._skip_reason = reason

    def _adopt_step(self, step: int) -> None:
        """Continues at the servers' ``step`` (elastic: a later step joined, or the step the
        servers came back to): drops what this rank held of its own step."""
        self._abandon_local()
        self._step, self._micro, self._clip_coef, self._inv_scale = step, 0, 1.0, 1.0
        self._check, self._members, self._skip_reason = None, None, ""
        self._invalidate()
        self._after_load()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.registered and torch.is_grad_enabled():
            self.join_step()  # elastic: a step is trained by its members only
            self._begin_training()
        return super().forward(*args, **kwargs)

    def get_model_metadata(self) -> dict[str, Any]:
        meta = super().get_model_metadata()
        meta.update(
            step=self._step,
            optimizer=self._opt_name,
            units=[name for name, _ in self._units],
            buffers={b.name: b.numel for b in self._flat_buffers},
        )
        return meta
