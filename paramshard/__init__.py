"""paramshard: train PyTorch models over gRPC shard servers.

The packages do the work (``server/``, ``client/``, ``strategies/``, ``protos/``); this one holds
the command line (``paramshard serve``, ``paramshard status``, ...; see ``paramshard.cli``) and
``LocalCluster`` (N ranks and their servers in one process; see ``paramshard.local_cluster``).
Importing it stays cheap: no grpc, numpy or torch until a command or ``LocalCluster`` needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paramshard.local_cluster import LocalCluster, RankFailed

__version__ = "0.1.0"

__all__ = ["LocalCluster", "RankFailed", "__version__"]

_LAZY = {"LocalCluster": "paramshard.local_cluster", "RankFailed": "paramshard.local_cluster"}


def __getattr__(name: str) -> Any:
    """``paramshard.LocalCluster`` imports its module on first use (PEP 562)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paramshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
