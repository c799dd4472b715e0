"""Training strategies over the shard servers: DDP, ZeRO-1, ZeRO-2, FSDP (ZeRO-3).

Knows models (torch) and talks to the servers only through ``client``.
"""

from strategies.base import ShardedModelBase
from strategies.config import ShardingConfiguration
from strategies.ddp import DDPModel
from strategies.fsdp import FSDPModel, ZeRO3Model
from strategies.hybrid import HybridShardedModel, HybridShardedOptimizer
from strategies.optim import (
    DDPOptimizer,
    FSDPOptimizer,
    OptimizationInputData,
    OptimizationResult,
    ShardedOptimizer,
    ZeRO1Optimizer,
    ZeRO2Optimizer,
    ZeRO3Optimizer,
)
from strategies.pipeline import (
    LoadBalancedPartitionStrategy,
    PipelineParallelModel,
    UniformPartitionStrategy,
    split_gpt,
)
from strategies.recovery import RecoveryReport, train_with_recovery
from strategies.tensor_model import TensorParallelModel
from strategies.tensor_parallel import (
    ColumnParallelLinear,
    ParallelCausalSelfAttention,
    ParallelMLP,
    RowParallelLinear,
    parallelize_gpt_blocks,
)
from strategies.topology import Topology
from strategies.zero import ZeRO1Model, ZeRO2Model

__all__ = [
    "ShardingConfiguration",
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
    "Topology",
    "PipelineParallelModel",
    "split_gpt",
    "UniformPartitionStrategy",
    "LoadBalancedPartitionStrategy",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelCausalSelfAttention",
    "ParallelMLP",
    "parallelize_gpt_blocks",
    "TensorParallelModel",
    "HybridShardedModel",
    "HybridShardedOptimizer",
]
