"""paramshard: train PyTorch models over gRPC shard servers.

The packages do the work (``server/``, ``client/``, ``strategies/``, ``protos/``); this one holds
the command line (``paramshard serve``, ``paramshard status``, ...; see ``paramshard.cli``).
Importing it stays cheap: no grpc, numpy or torch until a command needs them.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
