"""The shard server: holds slices of flat buffers and runs optimizers next to them.

Never imports torch: the server image needs only grpc, protobuf and numpy (+ cupy on GPUs).
"""

from paramshard.server.app import MALLOC_ENV, ShardServer
from paramshard.server.errors import ShardError

__all__ = ["ShardServer", "ShardError", "MALLOC_ENV"]
