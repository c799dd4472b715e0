"""The bounds of security.md's eighteenth round against what real callers send: a job of many
parameters is snapshot, a small all-reduce reaches a server of small messages, a read that
frees its chunk goes through at the memory limit, and a header cut into parts is bounded as a
whole (a review of commits e027dc5..3581ee1 found each broken; each test failed then)."""

from __future__ import annotations

import numpy as np
import pytest
from slot_probes import header, read, varint
from snapshot_job import client_for, snapshot_servers

from paramshard.client import ClusterSpec, ParamInfo, ShardClient, tools
from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.slot import CHUNK_RECORD_BYTES, array_charge, slot_charge
from paramshard.server.collectives.slots import SlotStore
from paramshard.server.rpc.parsers import HEADER_BYTES, Malformed, tensor
from paramshard.server.runtime.limits import MemoryBudget

pytestmark = pytest.mark.timeout(120)


def _field(number: int, body: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(body)) + body


def test_a_job_of_many_parameters_can_still_be_snapshot(servers, tmp_path) -> None:
    """server/rpc/parsers.py CONTROL_BYTES (4 MiB) applies to CommitSnapshot, whose
    manifest_json carries every parameter of every buffer of the job as JSON (plus the model
    config), while server/snapshots/files.py commits manifests up to MAX_MANIFEST_BYTES
    (64 MiB). A buffer of 40,000 parameters registers (its RegisterBuffer is 2.8 MB) but its
    snapshot's CommitSnapshot (5.6 MB) is refused INVALID_ARGUMENT "a request of ... bytes;
    at most 4,194,304", so the job can never be snapshot."""
    nodes = snapshot_servers(servers, 1, tmp_path / "snaps")
    c = client_for([s.address for s in nodes])
    try:
        n = 40_000
        params = [
            ParamInfo(
                f"model.layers.{i // 768}.mlp.experts.{i // 3 % 256}.w{i % 3}.weight", (1,), i
            )
            for i in range(n)
        ]
        c.register_buffer("many", "b", n, params=params, optimizer="sgd", hyper={"lr": 0.1})
        manifest = tools.snapshot(c, "many", "t")
        assert len(manifest["buffers"]["b"]["params"]) == n
    finally:
        c.close()


@pytest.mark.parametrize("bound", ["max_bytes", "budget"])
def test_a_read_that_frees_its_chunk_is_not_refused_at_the_memory_limit(bound: str) -> None:
    """server/collectives/slots.py read() reserves ENTRY_RECORD_BYTES for the reader before
    it frees the chunk: with slot memory (or the server's --max-memory budget) full, the read
    of a complete chunk, which would give all of it back, is refused RESOURCE_EXHAUSTED for
    want of 96 bytes, and the memory stays held (a team at its share can never drain its
    slots by reading them). Before the change reads never reserved."""
    key = "r:bc1"
    values = np.ones(4, np.float32)
    need = slot_charge(key) + CHUNK_RECORD_BYTES + array_charge(values)
    if bound == "max_bytes":
        store = SlotStore(max_bytes=need)
    else:
        store = SlotStore(budget=MemoryBudget(need))
    store.contribute(header(key), memoryview(values.tobytes()))
    assert store.usage() == (need, 1)
    h, payload = store.read(read(key), 1.0)
    assert h.chunk.numel == 4
    assert np.frombuffer(payload, np.float32).tolist() == [1.0] * 4
    assert store.usage() == (0, 0)


def test_a_header_split_over_repeated_fields_is_bounded_by_the_fast_codec() -> None:
    """protos/codec.py decode checks each occurrence of field 1 against HEADER_BYTES, but
    protobuf merges repeated occurrences: two headers of HEADER_BYTES / 2 + 1 kB each merge
    into one of 4.2 MB that the fast parser accepts, while the generated classes' parser
    (the same request) refuses it as "a header of 4,196,325 bytes". A hostile Contribute of
    64 such parts rebuilds the 64 MiB shape list the bound was added against."""
    part = _field(1, b"r:ar1/0") + _field(1000, b"\0" * (HEADER_BYTES // 2 + 1000))
    raw = _field(1, part) + _field(1, part)
    slow = tensor(pb.SlotHeader, pb.ContributeRequest, False)(raw)
    assert isinstance(slow, Malformed) and slow.oversize
    fast = tensor(pb.SlotHeader, pb.ContributeRequest, True)(raw)
    assert isinstance(fast, Malformed), f"accepted a header of {fast[0].ByteSize():,} bytes"
    assert "bytes; at most" in str(fast.error)


def test_a_small_all_reduce_to_a_server_of_small_messages_still_works(servers) -> None:
    """server/collectives/slot_checks.py check_header sizes a chunk as ``(chunk_numel or
    total_numel) * itemsize``; a client's chunk_numel is its chunk_bytes (16 MiB by default,
    client/collectives.py) whatever the tensor's size, so against a server run with
    --max-receive-mb 1 an all-reduce of 8 floats (one 32-byte chunk) is now refused
    INVALID_ARGUMENT "chunks of 16,777,216 bytes". At e027dc5 it returned the sum: the
    largest chunk a slot can hold is min(chunk_numel, total_numel) elements."""
    (s,) = servers(1, max_receive_bytes=1 << 20)
    c = ShardClient(ClusterSpec([s.address]), timeout_s=10, retries=1)
    try:
        assert c.chunk_bytes > 1 << 20
        got = c.all_reduce(np.arange(8, dtype=np.float32))
        assert got.tolist() == list(range(8))
    finally:
        c.close()
