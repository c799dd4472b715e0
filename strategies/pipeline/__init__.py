"""Pipeline parallelism for any ``nn.Module``: split at module boundaries (``split.py``),
placed by a partition (``partition.py``), run by a schedule (``schedules.py``), with
activations through the servers' mailboxes (``communications.py``); ``model.py`` puts it
together as ``PipelineParallelModel``."""

from paramshard.strategies.pipeline.model import PipelineParallelModel
from paramshard.strategies.pipeline.partition import (
    LoadBalancedPartitionStrategy,
    PartitionName,
    UniformPartitionStrategy,
    balanced_partition,
    block_container,
    default_split_points,
    partition_name,
    uniform_partition,
)
from paramshard.strategies.pipeline.schedules import ScheduleName, schedule_name
from paramshard.strategies.pipeline.split import StagePlan, plan_stages

__all__ = [
    "PipelineParallelModel",
    "PartitionName",
    "UniformPartitionStrategy",
    "LoadBalancedPartitionStrategy",
    "balanced_partition",
    "uniform_partition",
    "block_container",
    "default_split_points",
    "partition_name",
    "ScheduleName",
    "schedule_name",
    "StagePlan",
    "plan_stages",
]
