"""3D parallelism: pipeline x tensor x data, each rank computing only its share.

Composition (as torchtitan's parallelize step and Megatron-LM do it):
1. ``Topology`` places the rank on the [pipeline][tensor][data] grid and builds one client
   per group;
2. the pipeline group splits the model into stages and this rank keeps only its stage
   (``PipelineParallelModel``: activations travel through the servers' mailboxes);
3. the tensor group splits that stage's attention heads and MLP columns/rows (Megatron's f and
   g: partial sums all-reduced through the servers);
4. the data group shards what is left, this (stage, tensor-rank)'s parameters, over the
   servers ZeRO-1 style: one job per (stage, tensor rank), fp32 master and optimizer state on
   the servers, gradients averaged over the data-parallel replicas.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from strategies.base import _OWNERS, ShardedModelBase
from strategies.config import ShardingConfiguration
from strategies.optim import ShardedOptimizer, ZeRO1Optimizer
from strategies.pipeline import PartitionName, PipelineParallelModel
from strategies.schedules import ScheduleName
from strategies.tensor_parallel import gather_tensor_parallel_state, parallelize_gpt_blocks
from strategies.topology import Topology
from strategies.zero import ZeRO1Model

__all__ = ["HybridShardedModel", "HybridShardedOptimizer"]


class HybridShardedModel(ShardedModelBase):
    """``model`` (a GPT from examples/gpt.py, or an nn.Sequential for pipeline only) over
    ``pipeline_parallel_size x tensor_parallel_size x data_parallel_size`` ranks (-1: the rest
    of the world). ``train_on_batch(x, y)`` takes this data-parallel replica's part of the
    global batch (see ``data_parallel_rank`` / ``data_parallel_size``)."""

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
    ) -> None:
        self.topology = Topology(
            config.client.world_size,
            pipeline_parallel_size,
            tensor_parallel_size,
            data_parallel_size,
        )
        super().__init__(model, config)
        rank = config.client.rank
        self.groups = self.topology.group_clients(config.client)
        self.coords = self.topology.coords(rank)
        pp, tp, _ = self.coords
        self.pipeline = PipelineParallelModel(
            model, config, micro_batch_count, partition, schedule, pp_client=self.groups.pp
        )
        if self.topology.tensor_parallel_size > 1:
            parallelize_gpt_blocks(list(self.pipeline.stage.blocks.values()), self.groups.tp)
        # Only this rank's stage (and tensor shard of it) is a submodule: parameters() and the
        # optimizer see exactly what this rank holds.
        del self._modules["module"]
        self.stage = self.pipeline.stage
        dp_config = ShardingConfiguration(
            self.groups.dp,
            job=f"{config.job}.pp{pp}.tp{tp}",
            timeout_s=config.timeout_s,
            reduce_dtype=config.reduce_dtype,
            param_dtype=config.param_dtype,
        )
        self.replica = ZeRO1Model(self.stage, dp_config)
        self._named = [(n, p) for n, p in self.stage.named_parameters() if p.requires_grad]
        self._shapes = {n: p.shape for n, p in self._named}
        for _, p in self._named:  # an optimizer on parameters() belongs to this wrapper
            _OWNERS[id(p)] = self

    def __str__(self) -> str:
        return self.topology.describe(self.config.client.rank)

    @property
    def data_parallel_rank(self) -> int:
        return self.coords[2]

    @property
    def data_parallel_size(self) -> int:
        return self.topology.data_parallel_size

    # -- training ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """This stage's layers only; the whole model runs through ``train_on_batch``."""
        return self.stage(*args, **kwargs)

    def train_on_batch(self, x: Any, y: Any) -> float:
        """Forward and backward through the pipeline schedule over micro-batches, then the
        optimizer step; returns the global batch's loss (the same on every rank)."""
        if self.optimizer is None:
            raise RuntimeError("HybridShardedModel.train_on_batch needs a HybridShardedOptimizer")
        loss = self.pipeline.train_step(x, y, self.default_loss_function)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.data_parallel_size > 1:  # the global batch's loss: mean over the replicas
            loss = self.groups.dp.all_reduce(torch.tensor([float(loss)]), "mean")[0]
        return float(loss)

    def _attach(self, optimizer: Any) -> None:
        super()._attach(optimizer)
        self._replica_optimizer = ZeRO1Optimizer(
            optimizer.inner, self.replica.config, model=self.replica
        )

    def _optimizer_step(self) -> None:
        self._replica_optimizer.step()
        self._invalidate()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        raise NotImplementedError(
            "HybridShardedModel does not clip yet: the global norm must count tensor-parallel"
            " replicated parameters once across stages and tensor ranks"
        )

    def synchronize_gradients(self) -> None:
        self.replica.synchronize_gradients()

    def _local_gradients(self, run_backward: Any) -> dict[str, torch.Tensor]:
        return self._gradients_by_swapping(run_backward)

    # -- the whole model, gathered -------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The whole model's state dict under its own names, on every rank (collective over
        the tensor and pipeline groups)."""
        stage = gather_tensor_parallel_state(self.stage, self.groups.tp)
        full = self.pipeline._gather(self.pipeline._state_layouts, stage)
        return {k: full[k] for k in self.pipeline._full_keys if k in full}

    def _full_state(self) -> dict[str, torch.Tensor]:
        return {n: t.float() for n, t in self.state_dict().items()}

    def _load_full_state(self, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError(
            "HybridShardedModel cannot load a full state dict yet: load it into the model"
            " before wrapping it"
        )

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
