"""Data parallelism over the shard servers: DDP (``ddp``), ZeRO-1 and ZeRO-2 (``zero``) and FSDP
(``fsdp``), the server-sharded model they share (``sharded``) and the optimizer wrappers
(``optim``)."""

from paramshard.strategies.data_parallel.ddp import DDPModel
from paramshard.strategies.data_parallel.fsdp import FSDPModel, ZeRO3Model
from paramshard.strategies.data_parallel.optim import (
    DDPOptimizer,
    FSDPOptimizer,
    ShardedOptimizer,
    ZeRO1Optimizer,
    ZeRO2Optimizer,
    ZeRO3Optimizer,
)
from paramshard.strategies.data_parallel.sharded import ServerShardedModel
from paramshard.strategies.data_parallel.zero import ZeRO1Model, ZeRO2Model

__all__ = [
    "DATA_PARALLEL",
    "DDPModel",
    "DDPOptimizer",
    "FSDPModel",
    "FSDPOptimizer",
    "ServerShardedModel",
    "ShardedOptimizer",
    "ZeRO1Model",
    "ZeRO1Optimizer",
    "ZeRO2Model",
    "ZeRO2Optimizer",
    "ZeRO3Model",
    "ZeRO3Optimizer",
]

DATA_PARALLEL: dict[str, tuple[type, type]] = {
    "ddp": (DDPModel, DDPOptimizer),
    "zero1": (ZeRO1Model, ZeRO1Optimizer),
    "zero2": (ZeRO2Model, ZeRO2Optimizer),
    "fsdp": (FSDPModel, FSDPOptimizer),
}
"""The data-parallel strategies by their short names (``train_gpt.py --strategy``, the
benchmarks): name -> (model wrapper, optimizer wrapper)."""
