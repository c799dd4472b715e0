"""The Shard service's names on the wire, from shard.proto: one place for the paths that the
clients, the servers' peers and the tools call ("/paramshard.v1.Shard/Lease")."""

from __future__ import annotations

from paramshard.protos import shard_pb2 as pb

__all__ = ["SERVICE_NAME", "method_path"]

_SERVICE = pb.DESCRIPTOR.services_by_name["Shard"]
SERVICE_NAME = _SERVICE.full_name
"""The service's full name ("paramshard.v1.Shard")."""


def method_path(method: str) -> str:
    """The gRPC path of the service's ``method``; KeyError for a name the proto lacks."""
    return f"/{SERVICE_NAME}/{_SERVICE.methods_by_name[method].name}"
