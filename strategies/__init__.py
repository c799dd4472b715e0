"""Training strategies over the shard servers: DDP, ZeRO-1, ZeRO-2, FSDP (ZeRO-3).

Knows models (torch) and talks to the servers only through ``client``.
"""

from paramshard.strategies.base import ShardedModelBase
from paramshard.strategies.config import ShardingConfiguration
from paramshard.strategies.data_parallel import DATA_PARALLEL
from paramshard.strategies.data_parallel.ddp import DDPModel
from paramshard.strategies.data_parallel.elastic_checkpoints import JobLost
from paramshard.strategies.data_parallel.fsdp import FSDPModel, ZeRO3Model
from paramshard.strategies.data_parallel.optim import (
    DDPOptimizer,
    FSDPOptimizer,
    OptimizationInputData,
    OptimizationResult,
    ShardedOptimizer,
    ZeRO1Optimizer,
    ZeRO2Optimizer,
    ZeRO3Optimizer,
)
from paramshard.strategies.data_parallel.zero import ZeRO1Model, ZeRO2Model
from paramshard.strategies.grad_scaler import ShardedGradScaler
from paramshard.strategies.hybrid import HybridShardedModel, HybridShardedOptimizer
from paramshard.strategies.nonfinite import NonFiniteGradientError
from paramshard.strategies.pipeline import (
    LoadBalancedPartitionStrategy,
    PipelineParallelModel,
    UniformPartitionStrategy,
    default_split_points,
)
from paramshard.strategies.recovery import RecoveryReport, train_with_recovery
from paramshard.strategies.tensor import (
    ColumnParallelLinear,
    ColwiseParallel,
    RowParallelLinear,
    RowwiseParallel,
    TensorParallelModel,
    default_plan,
    parallelize_module,
)
from paramshard.strategies.topology import Topology

__all__ = [
    "ShardingConfiguration",
    "DATA_PARALLEL",
    "NonFiniteGradientError",
    "ShardedModelBase",
    "ShardedOptimizer",
    "DDPModel",
    "DDPOptimizer",
    "ZeRO1Model",
    "ZeRO1Optimizer",
    "ZeRO2Model",
    "ZeRO2Optimizer",
    "FSDPModel",
    "FSDPOptimizer",
    "ZeRO3Model",
    "ZeRO3Optimizer",
    "OptimizationInputData",
    "OptimizationResult",
    "train_with_recovery",
    "RecoveryReport",
    "JobLost",
    "Topology",
    "PipelineParallelModel",
    "default_split_points",
    "UniformPartitionStrategy",
    "LoadBalancedPartitionStrategy",
    "ColwiseParallel",
    "RowwiseParallel",
    "parallelize_module",
    "default_plan",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelModel",
    "HybridShardedModel",
    "HybridShardedOptimizer",
    "ShardedGradScaler",
]
