"""The shard server: holds slices of flat buffers and runs optimizers next to them.

Never imports torch: the server image needs only grpc, protobuf and numpy (+ cupy on GPUs).
Its sub-packages, lowest first (docs/design.md has a sentence on each); a module imports only
from packages below its own, and the top-level modules (``servicer``, ``snapshot_calls``,
``status``, ``metrics``, ``config``, ``app``) from any (tests/test_server_layers.py checks both):

    runtime < optimizers < snapshots < buffers < collectives < rpc < transport < replication

Importing this package loads nothing else: ``ShardServer`` and the others load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paramshard.server.app import MALLOC_ENV, ShardServer
    from paramshard.server.config import ServerConfig
    from paramshard.server.runtime.errors import ShardError

__all__ = ["ShardServer", "ServerConfig", "ShardError", "MALLOC_ENV"]

_HOME = {
    "ShardServer": "paramshard.server.app",
    "MALLOC_ENV": "paramshard.server.app",
    "ServerConfig": "paramshard.server.config",
    "ShardError": "paramshard.server.runtime.errors",
}


def __getattr__(name: str) -> Any:
    """The names of ``__all__`` import their module on first use (PEP 562)."""
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'paramshard.server' has no attribute {name!r}")
