"""Hostile replicas that a probe found the server took (docs/security.md, seventeenth round,
129-135): LoadReplica, FetchReplica and Restore over real gRPC against real servers on
127.0.0.1 with tokens. Each docstring tells what the server did before; each test failed on
that code. After each call: no INTERNAL or UNKNOWN, a message saying what was wrong, Status
still answers, and the server's state is as it was. Helpers: tests/replica_probes.py.
"""

from __future__ import annotations

import hashlib
import json

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

from paramshard.client import checkpoints
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.replication import recovery
from paramshard.server.snapshots.shards import Captured, encode_shard

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def server(servers) -> ShardServer:
    return hostile_server(servers)


@pytest.mark.parametrize("steps", [2**64, 2**53 + 1])
def test_a_replicas_step_count_is_bounded_as_a_clients_is(server, steps: int) -> None:
    """LoadReplica checks a replica's version against 2**53 but not its buffers' step_count
    (recovery.py ``_restore`` hands ``info["step_count"]`` to ``load_state``, whose ``_count``
    takes any int >= 0); docs/security.md bounds "optimizer step counts a client sets
    (SetParams, or a replica it loads)" at 2**53. With 2**64 the load answers OK and from then
    on every Status of the server (an unscoped reader's too: the replica came from team A's
    admin token, scoped to ``team-a-*``) and every PullParams of the job end INTERNAL
    ("ValueError: Value out of range: 18446744073709551616"). 2**53 + 1 loads as well."""
    job = "team-a-x"
    blob = crafted(job, 1, {"w": layout(job, step_count=steps)}, params())
    before = state(server)
    try:
        details = refused(
            server.address, "LoadReplica", chunk(job, blob), Code.INVALID_ARGUMENT, "a-admin"
        )
        assert "step" in details
    finally:
        status = call(server.address, "Status", pb.StatusRequest(), "reader-secret")
        call(server.address, "DropJob", pb.DropJobRequest(job=job))
    assert isinstance(status, pb.StatusReply), status.details()
    assert state(server) == before


def test_a_replicas_version_must_be_an_int_not_a_boolean(server) -> None:
    """The replica's header says ``"version": true``, its chunks version 1: ``check_header``
    compares True == 1 and ``_restore`` checks ``isinstance(version, int)``, which a bool
    passes. The load answers OK, the slices hold version True, and every Status then ends
    INTERNAL ("TypeError: Field paramshard.v1.BufferStatus.version: Expected an int, got a
    boolean"). (A step count of ``true`` is refused: ``_count`` excludes bools.)"""
    blob = crafted("j", True, {"w": layout("j")}, params())
    before = state(server)
    try:
        refused(server.address, "LoadReplica", chunk("j", blob), Code.INVALID_ARGUMENT)
    finally:
        status = call(server.address, "Status", pb.StatusRequest(), "reader-secret")
    assert isinstance(status, pb.StatusReply), status.details()
    assert state(server) == before


def test_a_replica_with_no_buffers_is_refused(server) -> None:
    """A replica of job 'j' whose metadata lists no buffers (``"buffers": {}``) passes every
    check (there is nothing to check) and ``replace_job`` swaps in zero slices: LoadReplica
    answers OK, job 'j''s buffer, params and optimizer state are gone (Status lists 'j' with no
    buffers, its bytes are released) and a trainer's pull of it fails."""
    blob = crafted("j", 7, {}, {})
    before = state(server)
    refused(server.address, "LoadReplica", chunk("j", blob, 7), Code.INVALID_ARGUMENT)
    assert state(server) == before


@pytest.mark.parametrize(
    "buffers",
    [
        {"w": layout("j", numel=2 * NUMEL, index=1, num=2)},  # slice 1 of 2; header: 0 of 1
        {"w": layout("j"), "v": layout("j", "v", numel=2 * NUMEL, index=0, num=2)},
    ],
    ids=["another-slice", "mixed-placements"],
)
def test_a_replicas_specs_are_placed_where_its_header_says(server, buffers) -> None:
    """The replica's header and chunks say server 0 of 1 (the job here is slice 0 of 1), its
    buffers' specs say otherwise; ``_restore`` checks each spec alone and each array against
    its own spec's slice. 'another-slice': OK, and this server, which held slice 0 of 1, now
    holds slice 1 of 2 of an 8-element buffer. 'mixed-placements': OK, and the job holds 'w'
    as slice 0 of 1 and 'v' as slice 0 of 2, which RegisterBuffer refuses ("every buffer of a
    job has the same placement")."""
    tensors = {**params("w"), **(params("v") if "v" in buffers else {})}
    blob = crafted("j", 3, buffers, tensors)
    before = state(server)
    refused(server.address, "LoadReplica", chunk("j", blob, 3), Code.INVALID_ARGUMENT)
    assert state(server) == before


def test_fetch_replica_sends_at_most_a_chunk(server, monkeypatch) -> None:
    """FetchReplica takes ``req.max_bytes or CHUNK``: max_bytes 2**64 - 1 copies the whole
    replica into one reply (bytes out of ``Parts``, then the message, then its wire form; the
    server sends messages of any size), outside --max-memory, once per concurrent call
    (GPT-2 124M: a 712 MB replica, 2 GB or more a call). Here CHUNK is 100 bytes and the reply
    carries the whole 384-byte replica."""
    monkeypatch.setattr(recovery, "CHUNK", 100)
    blob = own_replica()
    assert call(server.address, "StoreReplica", chunk("j", blob), "peer-secret").complete
    req = pb.FetchReplicaRequest(job="j", source_index=0, version=1, max_bytes=2**64 - 1)
    reply = call(server.address, "FetchReplica", req)
    assert reply.total == len(blob) > 100
    assert len(reply.data) <= 100


def test_incomplete_loads_of_one_job_stay_within_its_quota(servers) -> None:
    """A LoadReplica of a job not on the server is bounded by --max-job-gb per replica, but the
    inbox keeps 2 versions per source index and takes any source index for such a job: 10
    sources x 2 versions of 100 kB each keep 2 MB for one job whose quota is 150 kB, all
    answered OK (team A's scoped admin token; only --max-memory bounds the total)."""
    (node,) = servers(1, tokens=HOSTILE_TOKENS, max_job_bytes=150_000, replica_ttl_s=600)
    codes = []
    try:
        for source in range(10):
            for version in (1, 2):
                req = pb.ReplicaChunk(job="team-a-j", source_index=source, version=version)
                req.total, req.data = 150_000, b"x" * 100_000
                codes.append(code_of(call(node.address, "LoadReplica", req, "a-admin")))
        held = node.servicer.budget.usage()["replicas"]
    finally:
        call(node.address, "DropJob", pb.DropJobRequest(job="team-a-j"))
    assert node.servicer.budget.usage()["replicas"] == 0
    assert Code.RESOURCE_EXHAUSTED in codes
    assert held <= 150_000, f"{held:,} bytes of incomplete replicas of one job"


def test_a_planted_snapshots_step_count_is_bounded(servers, tmp_path) -> None:
    """server/snapshots/folders.py: whoever can write in the snapshot directory can plant a
    tag. A shard whose layout says ``"step_count": 2**64`` (its manifest's bytes and sha256
    matching it) restores OK (files.py ``layout`` takes ``int(info["step_count"])`` as it is),
    and every Status of the server then ends INTERNAL ("ValueError: Value out of range:
    18446744073709551616"). Expected: refused, as any other malformed shard layout is."""
    (node,) = servers(1, tokens=HOSTILE_TOKENS, snapshot_dir=str(tmp_path))
    admin = client_for([node.address])
    try:
        admin.register_buffer("j", "w", NUMEL, optimizer="sgd", hyper={"lr": 0.1})
        admin.set_params("j", "w", PARAMS)
        checkpoints.snapshot(admin, "j", "t1")
    finally:
        admin.close()
    (shard,) = (tmp_path / "j" / "t1").glob("shard-*")  # the same shard, but its step count
    planted = encode_shard("j", "t1", 0, 1, 0, [Captured("w", 0, PARAMS, {}, 2**64)])
    manifest_path = tmp_path / "j" / "t1" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["shards"][0].update(bytes=len(planted), sha256=hashlib.sha256(planted).hexdigest())
    for path, content in ((shard, planted), (manifest_path, json.dumps(manifest).encode())):
        path.chmod(0o644)
        path.write_bytes(content)
    req = pb.RestoreRequest(job="j", tag="t1", server_index=0, num_servers=1)
    try:
        out = call(node.address, "Restore", req)
        assert code_of(out) in (Code.FAILED_PRECONDITION, Code.INVALID_ARGUMENT), out
    finally:
        status = call(node.address, "Status", pb.StatusRequest(), "reader-secret")
    assert isinstance(status, pb.StatusReply)
