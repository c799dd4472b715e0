"""A session's batches (client/session.py, server/transport/sessions.py): which calls go together,
and their bytes on the wire.

Whatever is ready when the stream takes its next message goes in it, so calls made together
travel together, and one call alone is never held back waiting for company.

A batch is a ``SessionBatch`` message, but it is written and read by hand, as tensor messages
are (protos/codec.py): each call's body, the bulk of it, is copied once into the batch by the
join that writes it, and read in place, as a view of the received bytes. The generated classes
would copy it three times more on each side.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from typing import Any

from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb

__all__ = [
    "SESSION_METHODS", "TENSOR_REPLIES", "MAX_BATCH", "take_ready", "encode_batch",
    "decode_batch", "TooManyCalls",
]  # fmt: skip

SESSION_METHODS = (
    "Contribute", "ReadSlot", "ContributeRead", "PushGrad", "PullParams", "SetParams"
)  # fmt: skip
"""The calls a session carries: the data plane. The client sends only these in its sessions
(client/session.py) and the server takes only these from one (``ShardServicer``)."""
TENSOR_REPLIES = ("PullParams", "ReadSlot", "ContributeRead")
"""The data-plane calls whose replies carry a tensor: both sides count its bytes before the
call runs (client/rpc.py, a session's message size; server/call_peeks.py, a session's and
the gate's reply bytes)."""

MAX_BATCH = 1024
"""Calls in one batch, either way: a client sends at most what it has in flight, and a server
replies to no more than a session's calls in flight (server/transport/session_bounds.py)."""

_CALL_TAG = bytes([1 << 3 | 2])  # SessionBatch.calls
_BODY_TAG = bytes([3 << 3 | 2])  # SessionCall.body
_BODY = 3


def take_ready(
    items: queue.SimpleQueue[Any],
    end: Any,
    max_bytes: int | None = None,
    size: Callable[[Any], int] | None = None,
) -> tuple[list[Any], bool]:
    """Waits for one item of ``items``, then takes every other one already there, up to
    ``max_bytes`` of ``size(item)`` (the item that reaches it is the last taken). Returns them
    and whether ``end`` came (it stays queued for the next call, which returns at once)."""
    first = items.get()
    if first is end:
        items.put(end)
        return [], True
    batch = [first]
    total = size(first) if size else 0
    while max_bytes is None or total < max_bytes:
        try:
            more = items.get_nowait()
        except queue.Empty:
            return batch, False
        if more is end:
            items.put(end)
            return batch, True
        batch.append(more)
        total += size(more) if size else 0
    return batch, False


def encode_batch(calls: Sequence[tuple[pb.SessionCall, Any]]) -> bytes:
    """The wire bytes of a SessionBatch of ``calls``: (the call without its body, the body as
    bytes, any C-contiguous buffer, or a tensor message's (header, payload), encoded here)."""
    parts: list[Any] = []
    for head, body in calls:
        small = head.SerializeToString()
        if isinstance(body, tuple):
            pieces, nbytes = codec.encode_parts(*body)
        else:
            data = codec.byte_view(body)
            pieces, nbytes = [data], data.nbytes
        size = len(small)
        if nbytes:
            length = codec.varint(nbytes)
            size += len(_BODY_TAG) + len(length) + nbytes
            pieces = [_BODY_TAG, length, *pieces]
        parts += [_CALL_TAG, codec.varint(size), small]
        if nbytes:
            parts += pieces
    return b"".join(parts)


class TooManyCalls(codec.DecodeError):
    """A batch holds more calls than its reader takes."""


def decode_batch(raw: Any, limit: int | None = None) -> list[tuple[pb.SessionCall, memoryview]]:
    """A SessionBatch's calls: (the call without its body, a view of the body in ``raw``).
    Unknown fields are skipped; malformed bytes raise ``codec.DecodeError``, and more than
    ``limit`` calls ``TooManyCalls`` (before they are all parsed: a message of tiny calls
    would otherwise cost far more memory than its bytes)."""
    calls: list[tuple[pb.SessionCall, memoryview]] = []
    for field, _, _, value in codec.fields(memoryview(raw)):
        if field != 1 or value is None:
            continue
        if limit is not None and len(calls) >= limit:
            raise TooManyCalls(f"a batch of more than {limit} calls")
        head = pb.SessionCall()
        body = value[0:0]
        for inner, start, end, data in codec.fields(value):
            if inner == _BODY and data is not None:
                body = data
                continue
            try:
                head.MergeFromString(value[start:end])
            except Exception as exc:  # protobuf's DecodeError: a field of the wrong type
                raise codec.DecodeError(f"bad session call: {exc}") from exc
        calls.append((head, body))
    return calls
