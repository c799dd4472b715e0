"""Bad requests to collective slots and over the server's limits (message size, a job's
bytes, the slots' memory), each with its documented status code and a message naming the
thing, changing nothing. Fixtures shared with tests/test_bad_input.py, as in
test_bad_requests.py.
"""

from __future__ import annotations

import grpc
import numpy as np
import test_bad_input
from conftest import slot_held
from test_bad_input import make_client, rpc_error

from paramshard.client import ShardClient
from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb

server = test_bad_input.server  # the module's fixtures: one server with JOB/BUF
c = test_bad_input.c


# --- slots -------------------------------------------------------------------------------------


def slot(
    key: str,
    *,
    op: int = pb.SUM,
    expected: int = 2,
    readers: int = 1,
    total: int = 4,
    chunk_numel: int = 4,
    offset: int = 0,
    numel: int | None = None,
    dtype: int = pb.FLOAT32,
    contributor: int = 0,
    shape: tuple = (),
) -> pb.SlotHeader:
    numel = min(chunk_numel, total - offset) if numel is None else numel
    return pb.SlotHeader(
        key=key,
        op=op,
        expected=expected,
        readers=readers,
        total_numel=total,
        chunk_numel=chunk_numel,
        shape=shape,
        contributor=contributor,
        chunk=pb.Chunk(offset=offset, numel=numel, dtype=dtype),
    )


def payload_for(h: pb.SlotHeader) -> np.ndarray:
    return np.ones(h.chunk.numel, dtype=codec.numpy_dtype(h.chunk.dtype))


def test_slot_header_errors(c: ShardClient) -> None:
    cases = {
        "no key": (slot(""), "slot key"),
        "contributor": (slot("s1", contributor=2), "contributor 2 is outside 0..1"),
        "no contributors": (slot("s1", expected=0), "expected"),
        "no readers": (slot("s1", readers=0), "readers"),
        "unknown op": (slot("s1", op=9), "op 9"),
        "SET with two": (slot("s1", op=pb.SET, expected=2), "SET"),
        "MEAN of ints": (slot("s1", op=pb.MEAN, dtype=pb.INT64), "MEAN"),
        "chunk numel": (slot("s1", numel=3), "has 4 elements, not 3"),
        "chunk offset": (slot("s1", offset=2, numel=2), "offset 2"),
        "chunk_numel 0": (slot("s1", chunk_numel=0, numel=4), "chunk_numel"),
        "unknown dtype": (slot("s1", dtype=42), "dtype"),
    }
    for name, (h, text) in cases.items():
        payload = np.ones(max(h.chunk.numel, 0), np.float32)
        err = rpc_error(c.call, 0, "Contribute", (h, payload))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, (name, err)
        assert text in err.details, (name, err.details)
        if h.key:
            assert f"slot '{h.key}'" in err.details, name
    err = rpc_error(c.call, 0, "Contribute", (slot("s2"), np.ones(3, np.float32)))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "payload has 12 bytes" in err.details
    err = rpc_error(c.call, 0, "ReadSlot", pb.ReadSlotRequest(key=""))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT


def test_slot_meta_mismatch_is_failed_precondition(c: ShardClient) -> None:
    first = slot("meta", shape=(2, 2))
    assert not c.call(0, "Contribute", (first, payload_for(first))).duplicate
    mismatches = {
        "op": slot("meta", op=pb.MAX, contributor=1, shape=(2, 2)),
        "expected": slot("meta", expected=3, contributor=1, shape=(2, 2)),
        "readers": slot("meta", readers=2, contributor=1, shape=(2, 2)),
        "shape": slot("meta", contributor=1, shape=(4,)),
        "dtype": slot("meta", contributor=1, dtype=pb.FLOAT16, shape=(2, 2)),
        # a shape of its own total (a header whose shape does not hold its total is refused
        # on its own, INVALID_ARGUMENT: tests/test_request_bounds.py)
        "total_numel": slot("meta", total=8, contributor=1, shape=(2, 4)),
    }
    for name, h in mismatches.items():
        err = rpc_error(c.call, 0, "Contribute", (h, payload_for(h)))
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION, (name, err)
        assert "slot 'meta'" in err.details and name in err.details, (name, err.details)
    # a retry of the first contribution is a duplicate; the matching second one completes it
    assert c.call(0, "Contribute", (first, payload_for(first))).duplicate
    second = slot("meta", contributor=1, shape=(2, 2))
    c.call(0, "Contribute", (second, 2 * payload_for(second)))
    header, data = c.call(0, "ReadSlot", pb.ReadSlotRequest(key="meta"))
    assert list(header.shape) == [2, 2]
    np.testing.assert_array_equal(np.frombuffer(data, np.float32), [3, 3, 3, 3])
    err = rpc_error(c.call, 0, "ReadSlot", pb.ReadSlotRequest(key="meta"))
    assert err.code == grpc.StatusCode.NOT_FOUND and "meta" in err.details


# --- limits ------------------------------------------------------------------------------------


def test_message_over_max_receive_bytes(servers) -> None:
    (s,) = servers(1, max_receive_bytes=1 << 20)
    c = make_client([s.address])
    try:
        numel = 300_000  # 1.2 MB in a single SetParams message (chunk_bytes is 4 MiB)
        c.register_buffer("bigmsg", "b", numel)
        err = rpc_error(c.set_params, "bigmsg", "b", np.ones(numel, np.float32))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        (row,) = c.status()  # still serving; nothing was written
        (b,) = row["jobs"][0]["buffers"]
        assert b["initialized"] is False
        # the same values in messages under the limit go through
        small = make_client([s.address], chunk_bytes=1 << 19)
        small.set_params("bigmsg", "b", np.ones(numel, np.float32))
        assert small.pull_params("bigmsg", "b", numel)[::1000].tolist() == [1.0] * 300
        small.close()
    finally:
        c.close()


def test_max_job_bytes_quota(servers) -> None:
    (s,) = servers(1, max_job_bytes=10_000)
    c = make_client([s.address])
    try:
        # a slice counts what it reserves (slice_bytes): its arrays, 3 of fp32 with SGD, and
        # its record, 8,192 bytes
        err = rpc_error(c.register_buffer, "quota", "big", 1000)  # 20,192 bytes
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "quota" in err.details and "10,000" in err.details and "quota/big" in err.details
        c.register_buffer("quota", "small", 100)  # 9,392 bytes fit
        (row,) = c.status()
        assert [b["buffer"] for j in row["jobs"] for b in j["buffers"]] == ["small"]
        err = rpc_error(c.register_buffer, "quota", "second", 100)  # not a second in one job
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "18,784 bytes" in err.details
        c.register_buffer("other", "small", 100)  # the quota is per job
    finally:
        c.close()


def test_slot_memory_limit_rejects_without_side_effects(servers) -> None:
    (s,) = servers(1, max_slot_bytes=1024)
    c = make_client([s.address])
    try:
        big = slot("quota", total=512, chunk_numel=512)
        err = rpc_error(c.call, 0, "Contribute", (big, payload_for(big)))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "1,024" in err.details
        (row,) = c.status()
        assert int(row["open_slots"]) == 0 and int(row["slot_bytes"]) == 0
    finally:
        c.close()


def test_slot_memory_limit(servers) -> None:
    """The limit counts a slot's records beside its values: 128 floats fit exactly, 512 do
    not."""
    (s,) = servers(1, max_slot_bytes=slot_held("fits", 512))
    c = make_client([s.address])
    try:
        big = slot("quota", total=512, chunk_numel=512)
        err = rpc_error(c.call, 0, "Contribute", (big, payload_for(big)))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "slot 'quota'" in err.details
        ok = slot("fits", expected=1, total=128, chunk_numel=128)
        c.call(0, "Contribute", (ok, payload_for(ok)))
        (row,) = c.status()
        assert int(row["slot_bytes"]) == slot_held("fits", 512)
    finally:
        c.close()
