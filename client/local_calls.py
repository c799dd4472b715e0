"""Calls to a shard server of this process (protos/local_servers.py): no message, no socket.

The servicer runs the data-plane method as its gRPC handler would, errors included, on a pool
of its own; a host payload is handed over as a memoryview, a device one through DLPack.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from paramshard.protos import codec, local_servers
from paramshard.protos import shard_pb2 as pb

__all__ = ["HEADER_ROOM", "LocalRpcError", "LocalFuture", "local_call"]

HEADER_ROOM = 1024
"""Bytes a tensor message's header (and framing) takes at most, beside its payload."""
_local_pool: ThreadPoolExecutor | None = None
_local_pool_lock = threading.Lock()


class LocalRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _LocalContext:
    """The little of grpc.ServicerContext the servicer uses."""

    def __init__(self, timeout: float) -> None:
        self._deadline = time.monotonic() + timeout

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise LocalRpcError(code, details)


class LocalFuture:
    """What RpcCore.run needs of a grpc.Future: result(), a cancel() that wakes result(), and
    done callbacks, which run when the call ends or is cancelled (as grpc's do)."""

    def __init__(self, fut: Future) -> None:
        self._fut = fut
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Any], None]] = []
        self._cancelled = False
        fut.add_done_callback(lambda _: self._settle())

    def _settle(self) -> None:
        with self._lock:
            if self._wake.is_set():
                return
            self._wake.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def cancel(self) -> bool:
        self._cancelled = True
        self._settle()
        return True

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        with self._lock:
            if not self._wake.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def result(self, timeout: float | None = None) -> Any:
        self._wake.wait(timeout)
        if self._cancelled:
            raise grpc.FutureCancelledError()
        return self._fut.result(0)


def local_call(method: str, device_reply: bool, address: str, request: Any, timeout: float) -> Any:
    """Runs a data-plane call on a server of this process (protos/local_servers.py), or
    returns None (use gRPC). The payload is never encoded: a host array is handed over as a
    memoryview (the server adds straight from the caller's array), a device array through
    DLPack; messages over the server's receive limit still go through gRPC."""
    global _local_pool
    server = local_servers.lookup(address)
    if server is None or method not in server.methods:
        return None
    if isinstance(request, tuple):
        header, payload = request
        if not hasattr(payload, "__dlpack__") or isinstance(payload, np.ndarray):
            payload = codec.byte_view(payload)
        if payload.nbytes + header.ByteSize() + 32 > server.max_receive_bytes:
            if not isinstance(payload, memoryview):  # local_device said it would fit
                raise ValueError(f"{method}: a device payload too large for {address}")
            return None
        request = (header, payload)
    with _local_pool_lock:
        if _local_pool is None:  # waiting calls (ReadSlot, PullParams) hold a thread each
            _local_pool = ThreadPoolExecutor(64, thread_name_prefix="local-shard")

    def run() -> Any:
        reply = server.call(method, request, _LocalContext(timeout), device_reply)
        if isinstance(reply, bytes) and method == "PullParams":  # encoded under the lock
            reply = codec.decode(reply, pb.PullParamsHeader)
        return reply

    return LocalFuture(_local_pool.submit(run))
