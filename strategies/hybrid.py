"""3D parallelism: pipeline x tensor x data, each rank computing only its share.

Composition (as torchtitan's parallelize step and Megatron-LM do it):
1. ``Topology`` places the rank on the [pipeline][tensor][data] grid and builds one client
   per group;
2. the pipeline group splits the model into stages and this rank keeps only its stage
   (``PipelineParallelModel``: activations travel through the servers' mailboxes);
3. the tensor group splits that stage's attention heads and MLP columns/rows (Megatron's f and
   g: partial sums all-reduced through the servers);
4. the data group shards what is left, this (stage, tensor-rank)'s parameters, over its own
   servers ZeRO-1 style (ZeRO partitions over the N_d data-parallel ranks, arXiv 1910.02054):
   one job per (stage, tensor rank), master copy and optimizer state on the servers of the
   ranks that hold it, gradients averaged over the data-parallel replicas.

Each group's client has its members' servers only (``ShardClient.subgroup``), so a mailbox
is on the receiver's server and a part's slices are on its replicas' servers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paramshard.protos.placement import part_job
from paramshard.strategies.base import OWNERS, ShardedModelBase
from paramshard.strategies.config import ShardingConfiguration
from paramshard.strategies.data_parallel.optim import ShardedOptimizer, ZeRO1Optimizer
from paramshard.strategies.data_parallel.zero import ZeRO1Model
from paramshard.strategies.hybrid_checkpoints import HybridCheckpoints
from paramshard.strategies.layout import master_torch_dtype, norm_tensor, to_master
from paramshard.strategies.mixed_precision import outputs_for_loss
from paramshard.strategies.nonfinite import across_parts, name_parts, seen_by
from paramshard.strategies.pipeline import PartitionName, PipelineParallelModel, ScheduleName
from paramshard.strategies.pipeline.materialize import InitWeights
from paramshard.strategies.tensor import (
    gather_tensor_parallel_state,
    parallelize_module,
    tensor_parallel_part,
    tensor_parallel_splits,
)
from paramshard.strategies.tensor.random_state import same_draws
from paramshard.strategies.topology import Topology

__all__ = ["HybridShardedModel", "HybridShardedOptimizer"]


class HybridShardedModel(HybridCheckpoints, ShardedModelBase):
    """Any ``model`` over ``pipeline_parallel_size x tensor_parallel_size x
    data_parallel_size`` ranks (-1: the rest of the world). ``train_on_batch(x, y, **inputs)``
    takes this data-parallel replica's part of the global batch (see ``data_parallel_rank`` /
    ``data_parallel_size``); every rank of a replica is given the same part.

    ``split_points`` name the modules where pipeline stages begin (default: ``partition`` of
    the model's block container); ``parallelize_plan`` maps module names (``*`` wildcards) to
    tensor-parallel styles (default: the model's own plan, see ``strategies.tensor``).

    A model built on the meta device (``with torch.device("meta"): model = ...``) is made real
    on each rank for its own stage and tensor parts only, by ``init_weights``: a state dict or
    the path of a safetensors checkpoint (each rank reads only its tensors and parts), or
    ``"reset_parameters"`` / a callable ``fn(module)`` (e.g. ``model._init_weights``) replayed
    under ``init_seed`` in a whole build's order, so the values equal building it whole
    (``strategies/pipeline/materialize.py``); ``init_device`` (e.g. "cuda") is where they then
    live. A real model stays where it is: ``model.to("cuda")`` before wrapping it.
    """

    strategy = "hybrid"

    def __init__(
        self,
        model: nn.Module,
        config: ShardingConfiguration,
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = -1,
        *,
        micro_batch_count: int = 4,
        schedule: ScheduleName = "1f1b",
        partition: PartitionName = "uniform",
        virtual_stages: int | None = None,
        split_points: list[str] | None = None,
        parallelize_plan: dict[str, Any] | None = None,
        init_weights: InitWeights = None,
        init_seed: int | None = None,
        init_device: torch.device | str | None = None,
    ) -> None:
        self.topology = Topology(
            config.client.world_size,
            pipeline_parallel_size,
            tensor_parallel_size,
            data_parallel_size,
        )
        if config.replicate_every:
            raise ValueError(
                f"replicate_every={config.replicate_every}: neighbour replication is not built"
                " for 3D jobs (with dp = 1 a part's only server would hold its own replica);"
                " recover from snapshots: train_with_recovery(model, step, n, checkpoint_every=k)"
            )
        super().__init__(model, config)
        rank = config.client.rank
        self.groups = self.topology.group_clients(config.client)
        self.coords = self.topology.coords(rank)
        pp, tp, _ = self.coords
        tp_client = self.groups.tp

        def parallelize(whole: nn.Module, owns: Any) -> None:
            # on the real modules, before the split: this rank's stage only
            if tp_client.world_size > 1:
                tp_client.deterministic = config.deterministic
                parallelize_module(whole, tp_client, parallelize_plan, only=owns)

        self.pipeline = PipelineParallelModel(
            model,
            config,
            micro_batch_count,
            partition,
            schedule,
            pp_client=self.groups.pp,
            virtual_stages=virtual_stages,
            split_points=split_points,
            parallelize=parallelize,
            init_weights=init_weights,
            init_seed=init_seed,
            init_device=init_device,
        )
        # Only this rank's stage (and tensor shard of it) is a submodule: parameters() and the
        # optimizer see exactly what this rank holds.
        del self._modules["module"]
        self.stage = self.pipeline.stage
        dp_config = ShardingConfiguration(
            self.groups.dp,
            job=part_job(config.job, pp, tp),
            timeout_s=config.timeout_s,
            reduce_dtype=config.reduce_dtype,
            param_dtype=config.param_dtype,
            deterministic=config.deterministic,
            skip_nonfinite=config.skip_nonfinite,
        )
        self.replica = ZeRO1Model(self.stage, dp_config)
        self._verdict: tuple[int, list[str]] | None = None  # clipping's, for the step
        if self.topology.pipeline_parallel_size * self.topology.tensor_parallel_size > 1:
            self.replica.agree_on_finite = self._agree_on_finite
        # The servers' manifests say which tensors are tensor-parallel parts (export joins them).
        self.replica.param_splits = tensor_parallel_splits(self.stage, self.groups.tp)
        self._named = [(n, p) for n, p in self.stage.named_parameters() if p.requires_grad]
        self._shapes = {n: p.shape for n, p in self._named}
        self._masters = {n: master_torch_dtype(p.dtype) for n, p in self._named}
        for _, p in self._named:  # an optimizer on parameters() belongs to this wrapper
            OWNERS[id(p)] = self

    def __str__(self) -> str:
        return self.topology.describe(self.config.client.rank)

    @property
    def data_parallel_rank(self) -> int:
        return self.coords[2]

    @property
    def data_parallel_size(self) -> int:
        return self.topology.data_parallel_size

    # -- training ------------------------------------------------------------------------------
    def forward(self, x: Any = None, **inputs: Any) -> Any:
        """The whole model's forward through the pipeline, without backward (collective over
        the pipeline group): the last stage returns the output, the others None."""
        return self.pipeline(x, **inputs)

    def forward_backward(self, x: Any, y: Any, **inputs: Any) -> float:
        """Forward and backward of this replica's batch through the pipeline schedule, without
        the optimizer step (so ``clip_grad_norm_`` can run in between); returns the global
        batch's loss, the same on every rank."""

        def loss_fn(out: Any, target: Any) -> torch.Tensor:  # in float32 under bf16/fp16
            return self.default_loss_function(outputs_for_loss(self.config, out), target)

        with same_draws(self.groups.tp, "HybridShardedModel"):  # dropout: one draw a group
            loss = self.pipeline.train_step(x, y, loss_fn, **inputs)
        if self.data_parallel_size > 1:  # the global batch's loss: mean over the replicas
            loss = self.groups.dp.all_reduce(torch.tensor([loss], dtype=torch.float64), "mean")[0]
        return float(loss)

    def train_on_batch(
        self, x: Any, y: Any = None, max_grad_norm: float | None = None, **inputs: Any
    ) -> float:
        """Forward and backward through the pipeline schedule over micro-batches, then (with
        ``max_grad_norm``) clipping by the global norm, then the optimizer step; returns the
        global batch's loss (the same on every rank)."""
        if self.optimizer is None:
            raise RuntimeError("HybridShardedModel.train_on_batch needs a HybridShardedOptimizer")
        loss = self.forward_backward(x, y, **inputs)
        if max_grad_norm is not None:
            self.clip_grad_norm_(max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def _attach(self, optimizer: Any) -> None:
        super()._attach(optimizer)
        self._replica_optimizer = ZeRO1Optimizer(
            optimizer.inner, self.replica.config, model=self.replica
        )

    def _optimizer_step(self) -> None:
        try:
            self._replica_optimizer.step()
        finally:
            self.skipped_steps = self.replica.skipped_steps
            self._verdict = None
            self._invalidate()

    def _agree_on_finite(self, where: list[str]) -> list[str]:
        """A step is skipped in every part or in none (strategies/nonfinite.py): the verdict
        ``clip_grad_norm_`` reached this step, else one all-reduce over the world."""
        if self._verdict is not None and self._verdict[0] == self.replica.step_count:
            return self._verdict[1]
        return across_parts(self.config.client, self.topology, self.config.job, where)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips by the whole model's 2-norm, as ``torch.nn.utils.clip_grad_norm_`` on the
        unsplit model would, and returns that norm (the same on every rank). Collective: every
        rank calls it between ``forward_backward`` and the optimizer step.

        Each parameter counts once: the servers give each parameter's sum of squares of its
        data-parallel-averaged gradient (``GradNorm`` per parameter); a tensor-parallel part
        counts on every tensor rank (the parts make up the whole), a replicated tensor only on
        tensor rank 0, the last stage's copy of a tied embedding not at all (the first stage
        counts it), and each (stage, tensor rank) once, from data rank 0. One all-reduce of
        that scalar over the world sums it; the servers scale their slices at the step.
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_ supports the 2-norm only, got norm_type={norm_type}")
        replica = self.replica
        if not replica.registered:
            raise RuntimeError("clip_grad_norm_ needs a HybridShardedOptimizer attached first")
        mine = 0.0
        _, tp, dp = self.coords
        check = replica.reduced_grad_check(per_param=dp == 0)  # the step's finiteness comes along
        if dp == 0:
            copies = self.pipeline.copies
            for name, p, sq in replica.param_sums(check):
                if id(p) in copies or (tp != 0 and name not in replica.param_splits):
                    continue
                mine += sq
        world = self.config.client
        where = list(check.nonfinite)  # which parts are not finite rides on the same all-reduce
        share = torch.cat([torch.tensor([mine], dtype=torch.float64), seen_by(world, where)])
        summed = world.all_reduce(share, "sum")
        self._verdict = (
            replica.step_count,
            name_parts(summed[1:], world.rank, self.topology, self.config.job, where),
        )
        total = replica.clip_by(float(summed[0]), max_norm)  # a loss scaler's unscale_ too
        return norm_tensor(total, (p.dtype for _, p in self._named))

    def synchronize_gradients(self) -> None:
        self.replica.synchronize_gradients()

    def _unscale_grads(self, inv_scale: float) -> None:
        self.replica._unscale_grads(inv_scale)

    def _local_gradients(self, run_backward: Any) -> dict[str, torch.Tensor]:
        return self._gradients_by_swapping(run_backward)

    # -- the whole model, gathered -------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The whole model's state dict under its own names, on every rank (collective over
        the tensor and pipeline groups)."""
        # a param_dtype working copy is narrower than the servers' masters: read those
        state = self.replica.state_dict() if self._holds_working_copy() else None
        stage = gather_tensor_parallel_state(self.stage, self.groups.tp, state)
        return self.pipeline.gather_full_state_dict(stage)

    def _full_state(self) -> dict[str, torch.Tensor]:
        return {n: to_master(t) for n, t in self.state_dict().items()}

    def _load_full_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(tensors, strict=False)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Loads the whole model's state dict (as ``state_dict()`` returns it): each rank takes
        its stage's tensors, and of those its tensor-parallel parts, into its replica and its
        data group's servers. Every rank calls it with the same dict."""
        keys = self.pipeline.full_keys
        missing = [k for k in keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in keys]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}"
            )
        splits = self.replica.param_splits
        local = {}
        for name, t in self.stage.state_dict().items():
            if name not in state_dict:
                continue
            value = torch.as_tensor(state_dict[name])
            if name in splits:
                value = tensor_parallel_part(value, **splits[name])
            if value.shape != t.shape:
                raise ValueError(
                    f"load_state_dict: '{name}' has shape {list(value.shape)}, this rank's"
                    f" stage holds {list(t.shape)}"
                )
            local[name] = value
        self.replica.load_state_dict(local, strict=False)
        self._invalidate()
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    # -- optimizer state (this rank's parameters: its stage's tensor parts) ---------------------
    def optimizer_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """id(parameter) -> torch-format optimizer state of this rank's parameters (its stage,
        its tensor parts), read from its data group's servers."""
        return self.replica.optimizer_state()

    def load_optimizer_state(self, states: dict[int, dict[str, Any]]) -> None:
        """The inverse, on the same topology (collective over the data group)."""
        self.replica.load_optimizer_state(states)

    def get_model_metadata(self) -> dict[str, Any]:
        meta = super().get_model_metadata()
        meta.update(
            topology=str(self),
            pipeline_parallel_size=self.topology.pipeline_parallel_size,
            tensor_parallel_size=self.topology.tensor_parallel_size,
            data_parallel_size=self.topology.data_parallel_size,
        )
        return meta


class HybridShardedOptimizer(ShardedOptimizer):
    """The optimizer of a HybridShardedModel: its stage's parameters, stepped ZeRO-1 style on
    the servers of each (stage, tensor rank)'s data-parallel group."""
