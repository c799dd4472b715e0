"""How the servicer's requests are parsed and its replies serialised: plain protobuf messages, and
tensor messages as (header, payload view) through the hand-written codec or the generated
classes. A request whose bytes do not parse becomes a ``Malformed`` the guard refuses with
INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paramshard.protos import codec

__all__ = [
    "CONTROL_BYTES",
    "HEADER_BYTES",
    "MODEL_BYTES",
    "Malformed",
    "plain",
    "tensor",
    "tensor_reply",
]

CONTROL_BYTES = 4 * 2**20
"""The largest request of a method that carries no tensor, unparsed, but for the two that list
a model's parameters (``MODEL_BYTES``). Parsing a request allocates several times its size,
and a repeated field of one-byte numbers turned into Python objects tens of times: a read
token's 255 MiB ReleaseSegments list held the interpreter for 19 s and took the server from
64 MB to 5.2 GB before this bound."""
MODEL_BYTES = 68 * 2**20
"""RegisterBuffer's and CommitSnapshot's bound: a record of each parameter of a buffer (about
70-100 bytes; 40,000 took 2.8 MB) and the model's configuration (at most 1 MiB), or a
snapshot's manifest listing every parameter of the job (at most 64 MiB,
server/snapshots/files.py), with room for the request's other fields."""
HEADER_BYTES = 4 * 2**20
"""The largest header of a tensor message (an elastic step's member list is under 1 MiB at
65,536 members); its payload may be as large as a message."""


class Malformed:
    """Stands in for a request whose bytes did not parse, or that was too large to parse
    (``oversize``: ``error`` says how large it was and what the bound is)."""

    def __init__(self, error: Exception, oversize: bool = False) -> None:
        self.error = error
        self.oversize = oversize


def _oversize(got: int, most: int, what: str) -> Malformed:
    return Malformed(ValueError(f"{what} of {got:,} bytes; at most {most:,}"), oversize=True)


def plain(cls: Any, most: int | None = CONTROL_BYTES) -> Callable[[bytes], Any]:
    """Parser of ``cls``, refusing a request over ``most`` bytes unparsed (None: as large as a
    message may be, for the replica chunks that carry state)."""

    def parse(raw: bytes) -> Any:
        if most is not None and len(raw) > most:
            return _oversize(len(raw), most, "a request")
        try:
            return cls.FromString(raw)
        except Exception as exc:
            return Malformed(exc)

    return parse


def tensor(header_cls: Any, request_cls: Any, fast: bool) -> Callable[[bytes], Any]:
    """Deserialiser of a tensor message into (header, payload memoryview); a header over
    ``HEADER_BYTES`` is refused (the fast codec before it is parsed, the generated classes'
    after)."""

    def parse(raw: bytes) -> Any:
        try:
            if fast:
                return codec.decode(raw, header_cls, HEADER_BYTES)
            msg = request_cls.FromString(raw)
            if (size := msg.header.ByteSize()) > HEADER_BYTES:
                return _oversize(size, HEADER_BYTES, "a header")
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
