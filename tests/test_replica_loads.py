"""A replica that a caller hands a server (``LoadReplica``, admin; ``StoreReplica``, peer) is
a file anyone with the role can write: the specs, version and arrays inside it pass the checks
a registration's do, and a refusal leaves the server as it was (server/replication/recovery.py).

Found by a hostile probe of a server whose admin token was scoped to one team's jobs: a
replica at version 2**64 - 1 loaded, and every Status failed with INTERNAL after the next
step; a spec of 2**29 elements with one element of data allocated 2 GiB outside
``--max-memory`` before it was refused, and one of 2**40 ended INTERNAL (MemoryError); a
corrupt spec or a header nested 100,000 deep ended INTERNAL, and StoreReplica then kept the
bytes it had reserved; specs with a 100,000-character name, no contributors or another job's
name loaded as they were.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from test_hardening_replication import TOKENS, client_for, register

from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.servicer import SERVICE_NAME
from paramshard.server.snapshots.shards import Captured, encode_shard

pytestmark = pytest.mark.timeout(120)

NUMEL = 4


def spec(job: str, buffer: str = "w", numel: int = NUMEL, **kw: object) -> pb.RegisterBufferRequest:
    fields = {
        "ref": pb.BufferRef(job=job, buffer=buffer),
        "numel": numel,
        "num_servers": 1,
        "contributors": 1,
        "optimizer": pb.OptimizerSpec(name="sgd", hyper={"lr": 0.1}),
        **kw,
    }
    return pb.RegisterBufferRequest(**fields)


def replica(
    job: str, version: int = 1, buffer: str = "w", spec_bytes: bytes | None = None
) -> bytes:
    """A replica of slice 0 of 1 holding ``NUMEL`` elements, with ``spec_bytes`` as its
    buffer's spec (default: a well-formed one)."""
    captured = [Captured(buffer, 0, np.arange(NUMEL, dtype=np.float32), {}, 0)]
    if spec_bytes is None:
        spec_bytes = spec(job, buffer).SerializeToString()
    return encode_shard(job, "replica", 0, 1, version, captured, {buffer: spec_bytes})


def call(server: ShardServer, method: str, blob: bytes, job: str, version: int, token: str):
    chunk = pb.ReplicaChunk(job=job, version=version, total=len(blob), data=blob)
    with grpc.insecure_channel(server.address) as chan:
        stub = chan.unary_unary(
            f"/{SERVICE_NAME}/{method}",
            request_serializer=pb.ReplicaChunk.SerializeToString,
            response_deserializer=pb.ReplicaAck.FromString,
        )
        return stub(chunk, timeout=30, metadata=(("authorization", f"Bearer {token}"),))


def load(server: ShardServer, blob: bytes, job: str = "r", version: int = 1) -> grpc.RpcError:
    """LoadReplica of ``blob``, which must be refused with INVALID_ARGUMENT."""
    with pytest.raises(grpc.RpcError) as info:
        call(server, "LoadReplica", blob, job, version, "admin-secret")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value


@pytest.fixture
def server(servers) -> ShardServer:
    """A server with tokens holding job 'j' (a replica of it may be loaded over it)."""
    (node,) = servers(1, tokens=TOKENS)
    c = client_for([node.address])
    try:
        register(c, "j")
    finally:
        c.close()
    return node


def jobs(server: ShardServer) -> dict[str, list[tuple[str, int, int]]]:
    """Job -> (buffer, version, elements) of each of its buffers as the server holds them."""
    held = server.servicer.buffers.jobs().items()
    return {j: [(b.name, b.version, b.numel) for b in slices] for j, slices in held}


def test_a_replica_past_the_version_bound_is_refused(server) -> None:
    before, used = jobs(server), server.servicer.budget.used
    for job in ("r", "j"):  # a new job, and one the server holds
        err = load(server, replica(job, version=2**64 - 1), job, 2**64 - 1)
        assert "version 18,446,744,073,709,551,615 is over" in err.details()
    assert jobs(server) == before and server.servicer.budget.used == used


@pytest.mark.parametrize("numel", [2**29, 2**40])
def test_a_replica_whose_arrays_are_not_its_slice_is_refused_before_anything_is_built(
    server, numel: int
) -> None:
    """Its spec says ``numel`` elements, its arrays hold 4: before, the slice was built at the
    spec's size and filled from the 4 (2 GiB for 2**29, MemoryError for 2**40)."""
    before, used = jobs(server), server.servicer.budget.used
    err = load(server, replica("r", spec_bytes=spec("r", numel=numel).SerializeToString()))
    assert f"holds arrays of [4] elements where its slice 0 of 1 has {numel:,}" in err.details()
    assert jobs(server) == before and server.servicer.budget.used == used


@pytest.mark.parametrize(
    "bad, says",
    [
        (spec("r", "b" * 100_000), "a buffer name has 1..256 characters, got 100,000"),
        (spec("r", contributors=0), "contributors must be at least 1"),
        (spec("j"), "buffer 'w' holds the spec of 'j/w'"),  # another job's, loaded as 'r'
        (spec("r", master_dtype=pb.INT64), "master_dtype must be FLOAT32 or FLOAT64"),
        (b"\xff\xff\xff", "is malformed (DecodeError"),
    ],
)
def test_a_replicas_specs_pass_the_checks_of_a_registration(server, bad, says: str) -> None:
    buffer = bad.ref.buffer if isinstance(bad, pb.RegisterBufferRequest) else "w"
    spec_bytes = bad if isinstance(bad, bytes) else bad.SerializeToString()
    before = jobs(server)
    err = load(server, replica("r", buffer=buffer, spec_bytes=spec_bytes))
    assert says in err.details(), err.details()
    assert jobs(server) == before


def test_a_header_nested_past_the_parsers_limit_is_refused_and_its_bytes_released(
    servers,
) -> None:
    first, second = servers(2, tokens=TOKENS)
    c = client_for([first.address, second.address])
    try:
        register(c, "j")  # server 1 takes replicas of job 'j' from server 0
    finally:
        c.close()
    deep = b"[" * 20_000 + b"]" * 20_000  # within the replica bound of job 'j' (80 KB)
    blob = len(deep).to_bytes(8, "little") + deep
    callers = [(second, "StoreReplica", "peer-secret"), (first, "LoadReplica", "admin-secret")]
    for node, method, token in callers:
        used = node.servicer.budget.used
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                call(node, method, blob, "j", 1, token)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert "not a paramshard replica (RecursionError" in info.value.details()
        assert node.servicer.budget.used == used, method  # before: StoreReplica kept them
