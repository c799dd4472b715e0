"""How the servicer's requests are parsed and its replies serialised: plain protobuf messages, and
tensor messages as (header, payload view) through the hand-written codec or the generated
classes. A request whose bytes do not parse becomes a ``Malformed`` the guard refuses with
INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paramshard.protos import codec

__all__ = ["Malformed", "plain", "tensor", "tensor_reply"]


class Malformed:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def plain(cls: Any) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return cls.FromString(raw)
        except Exception as exc:
            return Malformed(exc)

    return parse


def tensor(header_cls: Any, request_cls: Any, fast: bool) -> Callable[[bytes], Any]:
    """Deserialiser of a tensor message into (header, payload memoryview)."""

    def parse(raw: bytes) -> Any:
        try:
            if fast:
                return codec.decode(raw, header_cls)
            msg = request_cls.FromString(raw)
            return msg.header, memoryview(msg.data)
        except Exception as exc:
            return Malformed(exc)

    return parse


def tensor_reply(reply_cls: Any, fast: bool) -> Callable[[Any], bytes]:
    def serialize(msg: Any) -> bytes:
        if isinstance(msg, bytes):
            return msg  # the handler encoded it already
        if fast:
            return codec.encode(*msg)
        header, payload = msg
        if not isinstance(payload, bytes):
            payload = memoryview(payload).cast("B").tobytes()
        return reply_cls(header=header, data=payload).SerializeToString()

    return serialize
