"""paramshard: train PyTorch models over gRPC shard servers.

Everything installs under this one name: ``paramshard.protos`` (the wire contract),
``paramshard.server`` (the shard server), ``paramshard.client`` (``ShardClient`` and the job
tools), ``paramshard.strategies`` (DDP, ZeRO, FSDP, 3D) and ``paramshard.models`` (the example
GPT). This package itself holds the command line (``paramshard.cli``), the launcher and
``LocalCluster``, and offers the names users write most::

    from paramshard import FSDPModel, FSDPOptimizer, ShardingConfiguration, LocalCluster

Importing it stays cheap: no grpc, numpy or torch until one of those names is used (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paramshard.client import ClusterSpec, ShardClient
    from paramshard.local_cluster import LocalCluster, RankFailed, RankLeft
    from paramshard.server import ShardServer
    from paramshard.strategies import (
        DDPModel,
        DDPOptimizer,
        FSDPModel,
        FSDPOptimizer,
        HybridShardedModel,
        HybridShardedOptimizer,
        RecoveryReport,
        ShardedGradScaler,
        ShardingConfiguration,
        ZeRO1Model,
        ZeRO1Optimizer,
        ZeRO2Model,
        ZeRO2Optimizer,
        ZeRO3Model,
        ZeRO3Optimizer,
        train_with_recovery,
    )

__all__ = [
    "LocalCluster",
    "RankFailed",
    "RankLeft",
    "ClusterSpec",
    "ShardClient",
    "ShardServer",
    "ShardingConfiguration",
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
    "HybridShardedModel",
    "HybridShardedOptimizer",
    "ShardedGradScaler",
    "train_with_recovery",
    "RecoveryReport",
    "__version__",
]

_HOME = {
    "LocalCluster": "paramshard.local_cluster",
    "RankFailed": "paramshard.local_cluster",
    "RankLeft": "paramshard.local_cluster",
    "ClusterSpec": "paramshard.client",
    "ShardClient": "paramshard.client",
    "ShardServer": "paramshard.server",
}
"""Name -> the module that defines it, imported on first use; the rest of ``__all__`` comes from
``paramshard.strategies``."""


def __getattr__(name: str) -> Any:
    """``paramshard.FSDPModel`` and the others import their module on first use (PEP 562);
    ``__version__`` is the installed distribution's, the one version there is."""
    import importlib

    if name in __all__ and name != "__version__":
        module = _HOME.get(name, "paramshard.strategies")
        return getattr(importlib.import_module(module), name)
    if name == "__version__":
        from importlib.metadata import version

        return version("paramshard")
    raise AttributeError(f"module 'paramshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
