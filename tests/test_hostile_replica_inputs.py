"""Hostile replicas the server already refused, probed where no other test does: lying
safetensors tables, every role on the replica calls, reads and rollbacks at the edges,
segment references, incomplete loads past --max-memory, loads racing DropJob. Real servers
on 127.0.0.1 with tokens; helpers: tests/replica_probes.py.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
from replica_probes import (
    HOSTILE_TOKENS,
    NUMEL,
    PARAMS,
    Code,
    call,
    chunk,
    code_of,
    crafted,
    hostile_server,
    layout,
    own_replica,
    params,
    refused,
    state,
)
from test_hardening_replication import client_for

from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def server(servers) -> ShardServer:
    return hostile_server(servers)


def _lying(tensors: dict[str, Any]) -> bytes:
    return crafted("j", 2, {"w": layout("j")}, tensors)


@pytest.mark.parametrize(
    "blob",
    [
        _lying({"w::params": ("F32", [NUMEL], PARAMS.tobytes(), [0, 1 << 40])}),
        _lying({"w::params": ("F32", [NUMEL + 1], PARAMS.tobytes(), None)}),
        _lying({"w::params": ("F16", [NUMEL], PARAMS.tobytes(), None)}),
        _lying({"w::params": ("XX", [NUMEL], PARAMS.tobytes(), None)}),
        _lying({"w::state.exp_avg": ("F32", [NUMEL], PARAMS.tobytes(), None)}),
        (2**63).to_bytes(8, "little") + _lying(params())[8:],
    ],
    ids=["offsets", "shape", "dtype", "no-dtype", "no-params", "header-length-2**63"],
)
def test_a_replica_whose_safetensors_header_lies_changes_nothing(server, blob) -> None:
    """The metadata is right (job, source, version: ``check_header`` passes), the tensor table
    or the header's length lies: refused while decoded, after its bytes were reserved."""
    before = state(server)
    details = refused(server.address, "LoadReplica", chunk("j", blob, 2), Code.INVALID_ARGUMENT)
    assert "not a paramshard" in details or "malformed" in details, details
    assert state(server) == before


def test_replica_calls_by_role(server) -> None:
    """LoadReplica, FetchReplica and RollbackToReplica are admin's, StoreReplica peer's: every
    other role (a scoped admin naming another team's job too), no token and an unknown one
    are refused before anything is read."""
    blob = crafted("j", 2, {"w": layout("j")}, params())
    calls = [
        ("LoadReplica", chunk("j", blob, 2)),
        ("FetchReplica", pb.FetchReplicaRequest(job="j", version=0, max_bytes=2**64 - 1)),
        ("RollbackToReplica", pb.RollbackRequest(job="j", version=0)),
        ("StoreReplica", chunk("j", blob, 2)),
    ]
    before = state(server)
    for method, req in calls:
        allowed = "peer-secret" if method == "StoreReplica" else "admin-secret"
        for token in {None, "bogus", *HOSTILE_TOKENS} - {allowed}:
            known = token in HOSTILE_TOKENS
            refused(
                server.address,
                method,
                req,
                Code.PERMISSION_DENIED if known else Code.UNAUTHENTICATED,
                token,
            )
    assert state(server) == before


def test_fetch_and_rollback_at_the_edges(server) -> None:
    """A replica read past its end is nothing (its total says where it ends), a version not
    kept is NOT_FOUND naming it, and none of it changes the server."""
    blob = own_replica()
    assert call(server.address, "StoreReplica", chunk("j", blob), "peer-secret").complete
    before = state(server)
    for offset, most in ((len(blob), 0), (2**64 - 1, 2**64 - 1), (10**12, 1)):
        req = pb.FetchReplicaRequest(job="j", version=1, offset=offset, max_bytes=most)
        reply = call(server.address, "FetchReplica", req)
        assert (reply.total, reply.data) == (len(blob), b"")
    reply = call(server.address, "FetchReplica", pb.FetchReplicaRequest(job="j", version=1))
    assert reply.data == blob  # max_bytes 0: a chunk (this replica is smaller)
    for job, version in (("j", 0), ("j", 1), ("j", 2**64 - 1), ("nojob", 1), ("", 1)):
        req = pb.RollbackRequest(job=job, version=version)
        assert f"'{job}' at v{version}" in refused(
            server.address, "RollbackToReplica", req, Code.NOT_FOUND
        )
    assert state(server) == before


def test_a_segment_reference_outside_the_callers_segment_changes_nothing(server) -> None:
    """LoadReplica naming the admin token's own segment: bytes past its end, no bytes, bytes
    both in-band and in the segment, another segment: refused; nothing is kept."""
    admin = client_for([server.address])  # open: its segments go when it closes
    try:  # a payload over SHM_MIN_BYTES: the admin token gets a segment
        admin.register_buffer("big", "w", 100_000, optimizer="sgd", hyper={"lr": 0.1})
        admin.set_params("big", "w", np.zeros(100_000, np.float32))
        segments = server.servicer.segments._segments  # noqa: SLF001
        seg, size = next((i, s.nbytes) for i, s in segments.items() if s.owner == "admin-secret")
        before = state(server)
        for segment, offset, nbytes, data, code in (
            (seg, size, 1, b"", Code.INVALID_ARGUMENT),
            (seg, 2**64 - 1, 2**64 - 1, b"", Code.INVALID_ARGUMENT),
            (seg, 0, 0, b"", Code.INVALID_ARGUMENT),
            (seg, 0, 8, b"x" * 8, Code.INVALID_ARGUMENT),
            (seg ^ 1, 0, 8, b"", Code.FAILED_PRECONDITION),
        ):
            ref = pb.ShmRef(segment=segment, offset=offset, nbytes=nbytes)
            req = pb.ReplicaChunk(job="j", version=1, total=64, shm=ref, data=data)
            refused(server.address, "LoadReplica", req, code)
        assert state(server) == before
    finally:
        admin.close()
    assert server.servicer.replicator.inbox.pending() == {}


def test_incomplete_loads_past_max_memory_are_refused_and_freed(servers) -> None:
    """Many sources' incomplete replicas of a job not here: refused past --max-memory, saying
    so, and DropJob gives every byte back."""
    (node,) = servers(1, tokens=HOSTILE_TOKENS, max_memory=2**20, replica_ttl_s=600)
    base = node.servicer.budget.used
    codes = []
    for source in range(12):
        req = pb.ReplicaChunk(job="gone", source_index=source, version=1, total=10**7)
        req.data = b"x" * 200_000
        out = call(node.address, "LoadReplica", req)
        codes.append(code_of(out))
        if isinstance(out, grpc.RpcError):
            assert "--max-memory" in out.details() and "200,000" in out.details()
    fit = (node.servicer.budget.limit - base) // 200_000
    assert 0 < fit < 12 and codes == ["OK"] * fit + [Code.RESOURCE_EXHAUSTED] * (12 - fit)
    assert node.servicer.budget.used <= node.servicer.budget.limit
    assert code_of(call(node.address, "DropJob", pb.DropJobRequest(job="gone"))) == "OK"
    assert node.servicer.budget.used == base
    assert node.servicer.replicator.inbox.pending() == {}


def test_load_replica_racing_drop_job_keeps_the_account(server) -> None:
    """LoadReplica of a job in two chunks while DropJob drops it, from 4 threads: no INTERNAL,
    and once the job is dropped at the end the account is back where it started."""
    base, deadline = server.servicer.budget.usage(), time.monotonic() + 60
    blobs = {v: own_replica(v, "race", 2_000) for v in range(1, 4)}
    codes, lock = [], threading.Lock()

    def load(i: int) -> None:
        version = i % 3 + 1
        blob = blobs[version]
        half = len(blob) // 2
        for offset, part in ((0, blob[:half]), (half, blob[half:])):
            if time.monotonic() < deadline:
                req = pb.ReplicaChunk(job="race", version=version, offset=offset, total=len(blob))
                req.data = part
                out = call(server.address, "LoadReplica", req)
                with lock:
                    codes.append(code_of(out))

    def drop(_: int) -> None:
        if time.monotonic() < deadline:
            call(server.address, "DropJob", pb.DropJobRequest(job="race"))

    with ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(fn, i) for i in range(30) for fn in (load, drop)]:
            f.result()
    assert set(codes) <= {"OK", Code.NOT_FOUND, Code.INVALID_ARGUMENT}
    call(server.address, "DropJob", pb.DropJobRequest(job="race"))
    assert server.servicer.replicator.inbox.pending() == {}
    assert server.servicer.budget.usage() == base


def test_a_replica_header_of_bytes_not_text_is_named_in_a_line(server) -> None:
    """A header of 51 kB that is not UTF-8: the refusal says why in a line. Before, it quoted
    the exception's repr, every byte of the header (200 kB, clipped to 2 KB of escapes)."""
    head = bytes(range(128, 256)) * 400  # 51 kB: within what a replica of job j may claim
    blob = len(head).to_bytes(8, "little") + head
    details = refused(server.address, "LoadReplica", chunk("j", blob), Code.INVALID_ARGUMENT)
    assert "not a paramshard replica (UnicodeDecodeError: 'utf-8' codec" in details, details
    assert len(details) < 400, details
