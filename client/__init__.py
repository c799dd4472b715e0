"""Clients of the shard servers: ClusterSpec, ShardClient (collectives and flat buffers).

Knows servers, not models: imports protos and grpc, never torch (torch tensors are accepted
and returned when the caller has torch loaded).
"""

from paramshard.client.buffers import ParamInfo, StepArgs
from paramshard.client.cluster import ClusterSpec
from paramshard.client.grad_check import GradCheck, NonFiniteGradientError
from paramshard.client.lease_holds import LeaseConflict
from paramshard.client.rpc import ShardClientError
from paramshard.client.shard_client import ShardClient

__all__ = [
    "ClusterSpec",
    "ShardClient",
    "ShardClientError",
    "LeaseConflict",
    "ParamInfo",
    "StepArgs",
    "GradCheck",
    "NonFiniteGradientError",
]
