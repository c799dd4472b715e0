"""``ShardServer``: one shard server, in-process (tests, notebooks) or as ``paramshard serve``."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from server import backend
from server.servicer import SERVICE_NAME, ShardServicer

__all__ = ["ShardServer", "MALLOC_ENV"]

# DESIGN section 7: glibc mmaps (and page-faults) every buffer >= 32 MiB afresh; these settings
# took a 256 MiB call from 0.35 to 0.96 GB/s. They only work if set before the interpreter starts.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "1073741824",
    "MALLOC_TRIM_THRESHOLD_": "4294967296",
    "MALLOC_ARENA_MAX": "1",
}


class ShardServer:
    """A shard server bound to ``host:port`` (port 0 picks a free one; see ``.address``).

    Binds 127.0.0.1 by default: a server holds the whole model's slice, so whoever reaches the
    port can read or overwrite it (DESIGN section 6).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        device: str = "cpu",
        max_workers: int = 128,
        max_receive_bytes: int = 256 * 2**20,
        max_wait_s: float = 600.0,
        max_job_bytes: int = 0,
        max_slot_bytes: int = 0,
        fast_codec: bool = True,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: list[Any] | None = None,
    ) -> None:
        backend.use_device(device)
        self.host = host
        self.servicer = ShardServicer(
            max_wait_s=max_wait_s, max_job_bytes=max_job_bytes, max_slot_bytes=max_slot_bytes
        )
        options = [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
        ]
        # Waiting handlers (pull at a version, read a slot) hold a thread each: size generously.
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="shard"),
            options=options,
            maximum_concurrent_rpcs=None,
            interceptors=interceptors or [],
        )
        self._server.add_generic_rpc_handlers((self.servicer.generic_handler(fast_codec),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if credentials is None:
            self.port = self._server.add_insecure_port(target)
        else:
            self.port = self._server.add_secure_port(target, credentials)
        if self.port == 0:
            raise OSError(f"cannot bind a shard server to {target}")

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def start(self) -> ShardServer:
        self._server.start()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float | None = None) -> None:
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait()

    def wait(self) -> None:
        self._server.wait_for_termination()

    def __enter__(self) -> ShardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
