"""A lying proxy in front of a real shard server (tests/test_lying_server_training.py).

``lying_proxy(target, **overrides)`` starts a gRPC server on 127.0.0.1:0 that forwards every
Shard call, as raw bytes with its metadata, to the real server at ``target``, except the
methods named in ``overrides``: a unary one is answered by ``fn(request_bytes, forward)``
(``forward(request_bytes)`` returns the real server's reply bytes), a streaming one by
``fn(request, forward)`` returning the reply messages' bytes as an iterator. So a trainer runs
its real strategy code against a server that answers truthfully until one reply lies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from lying_servers import serving

__all__ = ["Proxy", "lying_proxy", "SERVICE"]

SERVICE = "paramshard.v1.Shard"
_STREAMS = {"HoldLease": "unary_stream", "Session": "stream_stream"}


@dataclass
class Proxy:
    address: str
    calls: list[str] = field(default_factory=list)


def _forwarded_metadata(context: grpc.ServicerContext) -> list[tuple[str, Any]]:
    return [
        (k, v)
        for k, v in context.invocation_metadata()
        if not k.startswith((":", "grpc-")) and k not in ("user-agent", "te", "content-type")
    ]


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.Channel, overrides: dict[str, Callable], seen: list) -> None:
        self._channel, self._overrides, self._seen = channel, overrides, seen

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        path = details.method
        if not path.startswith(f"/{SERVICE}/"):
            return None
        name = path.rsplit("/", 1)[1]
        kind = _STREAMS.get(name, "unary_unary")
        upstream = getattr(self._channel, kind)(path)
        fn = self._overrides.get(name)

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            self._seen.append(name)
            md = _forwarded_metadata(context)

            def forward(req: Any) -> Any:
                try:
                    return upstream(req, metadata=md, timeout=30)
                except grpc.RpcError as exc:
                    if kind != "unary_unary":
                        raise
                    context.abort(exc.code(), exc.details())

            return fn(request, forward) if fn is not None else forward(request)

        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(call)


@contextmanager
def lying_proxy(target: str, **overrides: Callable) -> Iterator[Proxy]:
    """A proxy of the server at ``target`` whose ``overrides`` lie (see the module)."""
    seen: list[str] = []
    channel = grpc.insecure_channel(
        target,
        options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)],
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        handlers=[_Handler(channel, overrides, seen)],
        options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)],
    )
    try:
        with serving(server) as address:
            yield Proxy(address, seen)
    finally:
        channel.close()
