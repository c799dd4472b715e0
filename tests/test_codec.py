"""protos/codec.py: the hand-written wire format must be the generated classes' format, exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.batches import decode_batch, encode_batch

ROOT = Path(__file__).resolve().parent.parent
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
TEXT = st.text(max_size=20)
DTYPES = st.sampled_from(list(pb.DType.values()))

# (header class, request/reply class) of every message that carries a tensor
TENSOR_MESSAGES = {
    "SetParamsRequest": (pb.SetParamsHeader, pb.SetParamsRequest),
    "PushGradRequest": (pb.PushGradHeader, pb.PushGradRequest),
    "PullParamsReply": (pb.PullParamsHeader, pb.PullParamsReply),
    "ContributeRequest": (pb.SlotHeader, pb.ContributeRequest),
    "ReadSlotReply": (pb.SlotHeader, pb.ReadSlotReply),
}


def sample_header(header_cls: type) -> object:
    """A header with every kind of field set (strings, enums, nested, repeated, maps)."""
    ref = pb.BufferRef(job="jöb-1", buffer="unit.0/params")
    chunk = pb.Chunk(offset=123_456, numel=2**33 + 5, dtype=pb.BFLOAT16)
    if header_cls is pb.SetParamsHeader:
        return pb.SetParamsHeader(ref=ref, chunk=chunk, version=2**40)
    if header_cls is pb.PushGradHeader:
        return pb.PushGradHeader(
            ref=ref,
            chunk=chunk,
            step=7,
            contributor=3,
            micro=1,
            num_micro=4,
            step_args=pb.StepArgs(hyper={"lr": 0.1}, clip_coef=0.25),
        )
    if header_cls is pb.PullParamsHeader:
        return pb.PullParamsHeader(ref=ref, chunk=chunk, version=9)
    return pb.SlotHeader(
        key="run:ar1/0",
        op=pb.MEAN,
        expected=5,
        readers=4,
        total_numel=10**9,
        shape=[3, -1, 2**40],
        chunk=chunk,
        contributor=2,
        chunk_numel=2**20,
    )


PAYLOADS = {
    "empty": b"",
    "one": b"\x01",
    "127": bytes(range(127)),  # a one-byte length varint at its limit
    "128": bytes(range(128)),  # the first two-byte length
    "large": np.random.default_rng(0).integers(0, 256, 3 * 2**20 + 17, dtype=np.uint8).tobytes(),
}


@pytest.mark.parametrize("payload_name", list(PAYLOADS))
@pytest.mark.parametrize("message", list(TENSOR_MESSAGES))
def test_encode_matches_generated_classes(message: str, payload_name: str) -> None:
    header_cls, msg_cls = TENSOR_MESSAGES[message]
    payload = PAYLOADS[payload_name]
    for header in (sample_header(header_cls), header_cls()):
        expected = msg_cls(header=header, data=payload).SerializeToString()
        assert codec.encode(header, payload) == expected
        assert codec.serialize((header, payload)) == expected
        as_array = np.frombuffer(payload, dtype=np.uint8)
        assert codec.encode(header, as_array) == expected
        # and the runtime parses our bytes back into the same message
        assert msg_cls.FromString(codec.encode(header, payload)) == msg_cls(
            header=header, data=payload
        )


def test_encode_array_payload_is_little_endian_raw_bytes() -> None:
    values = np.array([1.5, -2.0, 3.25], dtype=np.float32)
    header = pb.SetParamsHeader(chunk=pb.Chunk(numel=3, dtype=pb.FLOAT32))
    raw = codec.encode(header, values)
    assert raw == pb.SetParamsRequest(header=header, data=values.tobytes()).SerializeToString()
    _, data = codec.decode(raw, pb.SetParamsHeader)
    np.testing.assert_array_equal(np.frombuffer(data, dtype="<f4"), values)


def test_serialize_plain_message_uses_runtime() -> None:
    msg = pb.StatusRequest()
    assert codec.serialize(msg) == b""
    req = pb.DropJobRequest(job="j")
    assert codec.serialize(req) == req.SerializeToString()


@pytest.mark.parametrize("payload_name", list(PAYLOADS))
@pytest.mark.parametrize("message", list(TENSOR_MESSAGES))
def test_decode_round_trip_zero_copy(message: str, payload_name: str) -> None:
    header_cls, _ = TENSOR_MESSAGES[message]
    payload = PAYLOADS[payload_name]
    header = sample_header(header_cls)
    raw = codec.encode(header, payload)
    got, data = codec.decode(raw, header_cls)
    assert got == header
    assert isinstance(data, memoryview)
    assert bytes(data) == payload
    if payload:
        # zero-copy: the payload view points into the received bytes, at the payload's place
        assert data.obj is raw
        base = np.frombuffer(raw, dtype=np.uint8).ctypes.data
        assert np.frombuffer(data, dtype=np.uint8).ctypes.data == base + len(raw) - len(payload)
    # the deserializer gRPC uses does the same
    got2, data2 = codec.deserializer(header_cls)(raw)
    assert got2 == header and bytes(data2) == payload


def test_decode_accepts_what_protobuf_accepts() -> None:
    header = sample_header(pb.PushGradHeader)
    head = header.SerializeToString()
    # data before header, an unknown varint field, an unknown fixed64 and fixed32 field,
    # a repeated header (protobuf merges) and a repeated data field (the last one wins)
    raw = (
        b"\x7a\x03abc"
        + b"\x10\x96\x01"
        + b"\x19"
        + bytes(8)
        + b"\x25"
        + bytes(4)
        + b"\x0a"
        + bytes([len(head)])
        + head
        + b"\x0a\x02\x18\x09"  # merges step=9 into the header
        + b"\x7a\x02xy"
    )
    ref = pb.PushGradRequest.FromString(raw)
    got, data = codec.decode(raw, pb.PushGradHeader)
    assert got == ref.header and got.step == 9 and got.contributor == 3
    assert bytes(data) == ref.data == b"xy"
    assert codec.decode(b"", pb.SlotHeader) == (pb.SlotHeader(), memoryview(b""))


MALFORMED = {
    "key varint truncated": b"\x80",
    "key varint truncated after header": b"\x0a\x00\xff\xff",
    "length varint truncated": b"\x0a\xff",
    "overlong varint": b"\x0a" + b"\xff" * 11 + b"\x01",
    "length past end": b"\x0a\x05abc",
    "huge declared length": b"\x7a\xff\xff\xff\xff\x0f" + b"x" * 16,
    "huge declared header length": b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\x7f",
    "wire type 3 (unterminated group)": b"\x0b",
    "wire type 4 (end group)": b"\x0c",
    "wire type 6": b"\x0e\x00",
    "wire type 7": b"\x7f\x00",
    "field number 0": b"\x02\x00",
    "truncated fixed64": b"\x09\x00\x00\x00",
    "truncated fixed32": b"\x1d\x00",
    "truncated varint value": b"\x10\x80\x80",
    "header bytes are garbage": b"\x0a\x03\xff\xff\xff",
    "header string field truncated": b"\x0a\x03\x0a\x05a",
    "header with invalid utf-8": b"\x0a\x06\x0a\x04\x0a\x02\xc3\x28",  # ref.job = b"\xc3("
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_decode_malformed_raises_decode_error(name: str) -> None:
    raw = MALFORMED[name]
    with pytest.raises(codec.DecodeError):
        codec.decode(raw, pb.PushGradHeader)
    # these bytes are malformed for protobuf too
    with pytest.raises(Exception):  # noqa: B017, PT011 - protobuf's DecodeError
        pb.PushGradRequest.FromString(raw)


@pytest.mark.parametrize(
    "key", [b"\x80\x80\x80\x80\x10", b"\x80\x80\x80\x80\x80\x02"], ids=["2**29", "2**32"]
)
def test_decode_rejects_field_numbers_protobuf_rejects(key: bytes) -> None:
    raw = key + b"\x00"  # a varint field with a field number past the protobuf maximum
    with pytest.raises(Exception):  # noqa: B017, PT011 - protobuf's DecodeError
        pb.ContributeRequest.FromString(raw)
    with pytest.raises(codec.DecodeError):
        codec.decode(raw, pb.SlotHeader)


def test_decode_error_is_a_value_error() -> None:
    assert issubclass(codec.DecodeError, ValueError)


# --- hypothesis ---------------------------------------------------------------------------

refs = st.builds(pb.BufferRef, job=TEXT, buffer=TEXT)
chunks = st.builds(pb.Chunk, offset=U64, numel=U64, dtype=DTYPES)
step_args = st.builds(
    pb.StepArgs,
    hyper=st.dictionaries(TEXT, st.floats(allow_nan=False), max_size=3),
    clip_coef=st.floats(allow_nan=False),
)
HEADERS = {
    "SetParamsRequest": st.builds(pb.SetParamsHeader, ref=refs, chunk=chunks, version=U64),
    "PushGradRequest": st.builds(
        pb.PushGradHeader,
        ref=refs,
        chunk=chunks,
        step=U64,
        contributor=U32,
        micro=U32,
        num_micro=U32,
        step_args=st.one_of(st.none(), step_args),
    ),
    "PullParamsReply": st.builds(pb.PullParamsHeader, ref=refs, chunk=chunks, version=U64),
    "ContributeRequest": st.builds(
        pb.SlotHeader,
        key=TEXT,
        op=st.integers(0, 4),
        expected=U32,
        readers=U32,
        total_numel=U64,
        shape=st.lists(I64, max_size=4),
        chunk=chunks,
        contributor=U32,
        chunk_numel=U64,
    ),
}
HEADERS["ReadSlotReply"] = HEADERS["ContributeRequest"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(), message=st.sampled_from(list(TENSOR_MESSAGES)), payload=st.binary(max_size=600)
)
def test_hypothesis_encode_decode(data: st.DataObject, message: str, payload: bytes) -> None:
    header_cls, msg_cls = TENSOR_MESSAGES[message]
    header = data.draw(HEADERS[message])
    raw = codec.encode(header, payload)
    reference = msg_cls(header=header, data=payload)
    if len(getattr(getattr(header, "step_args", None), "hyper", {})) < 2:
        assert raw == reference.SerializeToString()
    else:  # protobuf itself does not fix the order of map entries: compare what they mean
        assert msg_cls.FromString(raw) == reference
    got, view = codec.decode(raw, header_cls)
    assert got == header
    assert bytes(view) == payload


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=64))
def test_hypothesis_decode_random_bytes_agrees_with_protobuf(raw: bytes) -> None:
    """Random bytes either raise DecodeError, or decode to what the protobuf runtime reads."""
    try:
        header, data = codec.decode(raw, pb.SlotHeader)
    except codec.DecodeError:
        return
    if max(top_level_fields(raw), default=0) > MAX_FIELD:
        return  # test_decode_rejects_field_numbers_protobuf_rejects covers these
    ref = pb.ContributeRequest.FromString(raw)
    assert header == ref.header
    assert bytes(data) == ref.data


MAX_FIELD = 2**29 - 1


def top_level_fields(raw: bytes) -> list[int]:
    """Field numbers of a message that codec.decode accepted (so it is well delimited)."""

    def varint(pos: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            byte = raw[pos]
            value |= (byte & 0x7F) << shift
            pos, shift = pos + 1, shift + 7
            if not byte & 0x80:
                return value, pos

    fields, pos = [], 0
    while pos < len(raw):
        key, pos = varint(pos)
        fields.append(key >> 3)
        wire = key & 7
        if wire == 0:
            _, pos = varint(pos)
        elif wire == 2:
            length, pos = varint(pos)
            pos += length
        else:
            pos += 8 if wire == 1 else 4
    return fields


@settings(max_examples=150, deadline=None)
@given(data=st.data(), cut=st.integers(1, 10**6))
def test_hypothesis_truncated_messages_raise(data: st.DataObject, cut: int) -> None:
    """Any strict prefix of a message that ends inside its payload is malformed."""
    header = data.draw(HEADERS["PushGradRequest"])
    payload = data.draw(st.binary(min_size=1, max_size=200))
    raw = codec.encode(header, payload)
    prefix = raw[: len(raw) - 1 - cut % len(payload)]  # drops 1..len(payload) bytes
    with pytest.raises(codec.DecodeError):
        codec.decode(prefix, pb.PushGradHeader)


# --- the generated modules -----------------------------------------------------------------


def test_generated_modules_match_proto() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "paramshard.protos.generate", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_proto_declares_every_tensor_message_with_data_at_15() -> None:
    for _, msg_cls in TENSOR_MESSAGES.values():
        fields = {f.name: f.number for f in msg_cls.DESCRIPTOR.fields}
        assert fields == {"header": 1, "data": 15}


def test_session_batches_read_and_write_as_the_generated_classes_do() -> None:
    """protos/batches.py writes and reads SessionBatch by hand: the same bytes protobuf
    writes and reads, bodies as views of the received bytes."""
    calls = [
        (pb.SessionCall(id=7, method="ReadSlot", timeout_s=1.5), b"\x01\x02"),
        (pb.SessionCall(id=2**40, code=5, details="gone"), b""),
        (pb.SessionCall(id=1), np.arange(3, dtype=np.float32)),
    ]
    raw = encode_batch(calls)
    parsed = pb.SessionBatch.FromString(raw)
    assert [c.id for c in parsed.calls] == [7, 2**40, 1]
    assert parsed.calls[0].method == "ReadSlot" and parsed.calls[0].timeout_s == 1.5
    assert parsed.calls[1].code == 5 and parsed.calls[1].details == "gone"
    assert parsed.calls[2].body == np.arange(3, dtype=np.float32).tobytes()
    back = decode_batch(parsed.SerializeToString())
    assert [(h.id, bytes(b)) for h, b in back] == [(c.id, c.body) for c in parsed.calls]
    assert back[0][0].method == "ReadSlot" and back[1][0].details == "gone"


@pytest.mark.parametrize(
    "raw",
    [b"\x0a\x05\x08", b"\x0a\x02\x1a\x05", b"\x0b", b"\x0a\x02\x12\x80", b"\x0a\x02\x28\xff"],
)
def test_malformed_session_batches_raise_decode_errors(raw: bytes) -> None:
    with pytest.raises(codec.DecodeError):
        decode_batch(raw)


def test_copy_into_writes_the_bytes_at_the_start_of_a_writable_buffer() -> None:
    """``copy_into`` (the copy into a shared segment, through NumPy so the GIL is free) writes
    exactly ``data``'s bytes at the start of ``dest`` and nothing after them."""
    import mmap

    seg = mmap.mmap(-1, 64)
    view = memoryview(seg)
    try:
        values = np.arange(6, dtype=np.float32)
        codec.copy_into(view[8:], codec.byte_view(values))
        assert bytes(view[8:32]) == values.tobytes()
        assert bytes(view[:8]) == bytes(8) and bytes(view[32:]) == bytes(32)
        codec.copy_into(view, memoryview(b""))  # nothing to copy: nothing changes
        assert bytes(view[8:32]) == values.tobytes()
    finally:
        view.release()
        seg.close()
