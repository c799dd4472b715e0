"""Tensor codec: arrays <-> the protobuf wire bytes of shard.proto's tensor-carrying messages.

Every message that carries a tensor is ``{ Header header = 1; bytes data = 15; }``. The protobuf
runtime copies a ``bytes`` field on parse and again on serialise (docs/design.md §7.5: raw payloads
were 1.6-2.4x faster at half the CPU), so we write those two fields by hand:

    0x0A <varint len(header)> <header bytes>  0x7A <varint len(data)> <data bytes>

which is exactly what ``Message(header=h, data=d).SerializeToString()`` produces (fields in
number order; an empty ``data`` is omitted, as proto3 does). Decoding walks the same fields and
returns the payload as a zero-copy ``memoryview`` that ``numpy.frombuffer`` can wrap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from paramshard.protos import shard_pb2 as pb

__all__ = [
    "BadReply",
    "DecodeError",
    "values_of",
    "byte_view",
    "copy_into",
    "WIRE_DTYPES",
    "dtype_name",
    "numpy_dtype",
    "wire_dtype",
    "MASTER_DTYPES",
    "master_dtype",
    "encode",
    "decode",
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
    "serialize",
    "deserializer",
    "read_varint",
    "varint",
]

H = TypeVar("H")

_HEADER_TAG = b"\x0a"  # field 1, wire type 2 (length-delimited)
_DATA_TAG = b"\x7a"  # field 15, wire type 2


class DecodeError(ValueError):
    """The bytes are not a well-formed tensor message."""


class BadReply(ValueError):
    """A server's reply does not hold what its call asked for (a pull's values of another
    size, a reply placed outside the caller's segment): its values are not used."""


# wire dtype -> (name, numpy dtype of the raw payload). bfloat16 travels as its uint16 bits.
WIRE_DTYPES: dict[int, tuple[str, np.dtype]] = {
    pb.FLOAT32: ("float32", np.dtype("<f4")),
    pb.FLOAT16: ("float16", np.dtype("<f2")),
    pb.BFLOAT16: ("bfloat16", np.dtype("<u2")),
    pb.INT64: ("int64", np.dtype("<i8")),
    pb.INT32: ("int32", np.dtype("<i4")),
    pb.FLOAT64: ("float64", np.dtype("<f8")),
}
_BY_NAME = {name: code for code, (name, _) in WIRE_DTYPES.items()}


def wire_dtype(name: str) -> int:
    """Wire enum for a dtype name ("float32", "bfloat16", ...)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(_BY_NAME)}") from None


MASTER_DTYPES = ("float32", "float64")
"""The dtypes a flat buffer's master copy and optimizer state are kept in (docs/design.md §3.1)."""


def master_dtype(dtype: Any) -> str:
    """The master dtype of values of dtype ``dtype`` (a name such as "bfloat16", a torch dtype
    such as ``torch.float64``, or a NumPy dtype): float64 stays float64, every other dtype has
    a float32 master. The one statement of that rule, for trainers, tools and servers."""
    return "float64" if str(dtype).removeprefix("torch.") == "float64" else "float32"


def dtype_name(code: int) -> str:
    if code not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {code}; supported: {sorted(_BY_NAME)}")
    return WIRE_DTYPES[code][0]


def numpy_dtype(code: int) -> np.dtype:
    """NumPy dtype of a payload's raw elements (uint16 for bfloat16)."""
    if code not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {code}; supported: {sorted(_BY_NAME)}")
    return WIRE_DTYPES[code][1]


def bf16_bits_to_f32(bits: Any, xp: Any = np) -> Any:
    """uint16 bfloat16 bit patterns -> float32 values (exact). ``xp``: numpy or cupy."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def f32_to_bf16_bits(values: Any, xp: Any = np) -> Any:
    """float32 -> uint16 bfloat16 bits, rounding to nearest even as torch does; NaN stays NaN."""
    u = xp.ascontiguousarray(values, dtype=xp.float32).view(xp.uint32)
    rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return xp.where(nan, (u >> 16) | 0x40, rounded).astype(xp.uint16)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def byte_view(payload: Any) -> memoryview:
    """``payload`` (bytes, or a host array, made C-contiguous if it is not) as a flat view
    of its bytes: what a message or a shared segment copies from, read in place."""
    if isinstance(payload, np.ndarray):
        payload = np.ascontiguousarray(payload)
    return memoryview(payload).cast("B")


def values_of(data: Any, dtype: Any, numel: int) -> np.ndarray:
    """The ``numel`` elements of ``dtype`` a reply's payload ``data`` holds, read in place;
    ``BadReply`` when it holds another number of bytes: NumPy would spread a reply of one
    value over the whole range it is stored in, silently."""
    values = np.frombuffer(data, dtype=np.uint8)
    want = numel * np.dtype(dtype).itemsize
    if values.nbytes != want:
        raise BadReply(f"{values.nbytes:,} bytes of values where {numel:,} x {dtype} were asked")
    return values.view(dtype)


def copy_into(dest: Any, data: memoryview) -> None:
    """``dest[: data.nbytes] = data`` (``dest``: a writable buffer, a shared segment's map)
    through NumPy, which copies without holding the GIL: a memoryview's slice assignment holds
    it for the whole copy, so a server writing pulls of 24 MB into readers' segments held up
    its other threads, the optimizer step's included, a copy at a time."""
    n = data.nbytes
    np.copyto(np.frombuffer(dest, np.uint8, n), np.frombuffer(data, np.uint8, n))


def encode(header: Any, payload: Any = b"") -> bytes:
    """Serialise ``header`` (a protobuf message) and a raw payload into one wire message.

    ``payload`` is bytes, or any C-contiguous buffer (a NumPy array): the join reads it in place,
    so the payload is copied once, into the message grpcio needs as ``bytes`` (docs/design.md §7.1).
    """
    return b"".join(encode_parts(header, payload)[0])


def encode_parts(header: Any, payload: Any = b"") -> tuple[list[Any], int]:
    """The pieces of ``encode``'s message, not yet joined, and their length: a message inside
    another (a session's batch, protos/batches.py) joins them once with the rest."""
    head = header.SerializeToString()
    data = byte_view(payload)
    parts = [_HEADER_TAG, varint(len(head)), head]  # the header is always present
    if data.nbytes:
        parts += [_DATA_TAG, varint(data.nbytes), data]
    return parts, sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)


def read_varint(buf: Any, pos: int, end: int | None = None) -> tuple[int, int]:
    """(the varint at ``buf[pos:]``, the position after it), reading no further than ``end``
    (default: the end of ``buf``); DecodeError when it is cut short or longer than 64 bits."""
    end = len(buf) if end is None else end
    if pos < end and buf[pos] < 0x80:  # one byte: nearly every key and length
        return buf[pos], pos + 1
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise DecodeError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def fields(buf: memoryview) -> Iterator[tuple[int, int, int, memoryview | None]]:
    """The fields of the protobuf message in ``buf``: (number, start, end, value), where
    ``buf[start:end]`` is the whole field (key included) and ``value`` a view of a
    length-delimited field's bytes (None for the other wire types). Malformed bytes raise
    ``DecodeError``."""
    pos, end = 0, len(buf)
    while pos < end:
        start = pos
        key, pos = read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if field == 0 or field > 0x1FFFFFFF:
            raise DecodeError(f"field number {field} is outside 1..2**29-1")
        if wire == 0:
            _, pos = read_varint(buf, pos)
            yield field, start, pos, None
            continue
        if wire in {1, 5}:
            pos += 8 if wire == 1 else 4
            if pos > end:
                raise DecodeError("truncated fixed-width field")
            yield field, start, pos, None
            continue
        if wire != 2:
            raise DecodeError(f"unsupported wire type {wire} for field {field}")
        length, pos = read_varint(buf, pos)
        if pos + length > end:
            raise DecodeError(f"field {field} claims {length} bytes, {end - pos} remain")
        pos += length
        yield field, start, pos, buf[pos - length : pos]


def decode(raw: bytes, header_cls: type[H], max_header: int | None = None) -> tuple[H, memoryview]:
    """Parse a tensor message into (header message, payload memoryview). Zero-copy payload.

    Unknown fields are skipped as protobuf would; anything malformed, or a header over
    ``max_header`` bytes in all its parts (the rest left unparsed), raises ``DecodeError``.
    """
    buf = memoryview(raw)
    header = header_cls()
    data = buf[0:0]
    header_bytes = 0  # protobuf merges a field that comes again: all its parts count
    for field, _, _, value in fields(buf):
        if value is None:
            continue
        if field == 1:
            header_bytes += len(value)
            if max_header is not None and header_bytes > max_header:
                raise DecodeError(f"a header of {header_bytes:,} bytes; at most {max_header:,}")
            try:
                header.MergeFromString(value)  # type: ignore[attr-defined]
            except Exception as exc:  # protobuf's DecodeError
                raise DecodeError(f"bad header: {exc}") from exc
        elif field == 15:
            data = value
    return header, data


def serialize(msg: Any) -> bytes:
    """gRPC serializer: a ``(header, payload)`` tuple takes the fast path, a message the runtime."""
    if isinstance(msg, tuple):
        return encode(*msg)
    return msg.SerializeToString()


def deserializer(header_cls: type[H]) -> Callable[[bytes], tuple[H, memoryview]]:
    """gRPC deserializer returning ``(header, payload memoryview)``."""

    def deserialize(raw: bytes) -> tuple[H, memoryview]:
        return decode(raw, header_cls)

    return deserialize
