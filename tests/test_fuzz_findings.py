"""What the chaos fuzzer (tests/test_chaos_fuzz.py) found, one fast test per defect: each
request below once crashed a server, made it allocate without bound, or broke a listing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from chaos_target import client, grants, metadata
from chaos_values import N

from paramshard.client import tools
from paramshard.protos import shard_pb2 as pb
from paramshard.server.runtime.request_bounds import MAX_SERVERS


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An in-process server with tokens and a job 'j' (buffer "w"), called over gRPC."""
    from paramshard.server import ShardServer

    tokens = grants()
    snapshots = tmp_path_factory.mktemp("snapshots")
    s = ShardServer(tokens=tokens, snapshot_dir=str(snapshots), max_wait_s=0.5, local_calls=False)
    s.start()
    c = client(s.address)
    c.register_buffer("j", "w", N, optimizer="adam", hyper={"lr": 0.01})
    c.set_params("j", "w", np.zeros(N, np.float32))
    c.close()
    yield s
    s.stop(0)


def call(address: str, path: str, payload: bytes, role: str = "admin") -> tuple[Any, str, bytes]:
    """One unary call of raw bytes: (code, details, reply bytes or b"")."""
    with grpc.insecure_channel(address) as chan:
        stub = chan.unary_unary(path, request_serializer=None, response_deserializer=None)
        try:
            return grpc.StatusCode.OK, "", stub(payload, timeout=10, metadata=metadata(role))
        except grpc.RpcError as exc:
            return exc.code(), exc.details(), b""


SHARD = "/paramshard.v1.Shard/"


def test_pending_work_of_a_slot_expecting_millions_of_ranks_lists_a_few(server: Any) -> None:
    """Status --pending listed every missing rank: a slot expecting 2**32 - 1 contributors
    took the server to 22 GB and the OOM killer (2**22 here keeps a regression survivable)."""
    many = 2**22
    header = pb.SlotHeader(
        key="fz:ar0/0",
        expected=many,
        readers=many,
        total_numel=1,
        chunk_numel=1,
        chunk=pb.Chunk(numel=1, dtype=pb.FLOAT32),
    )
    request = pb.ContributeRequest(header=header, data=np.ones(1, np.float32).tobytes())
    code, details, _ = call(server.address, SHARD + "Contribute", request.SerializeToString())
    assert code == grpc.StatusCode.OK, details
    push = pb.RegisterBufferRequest(
        ref=pb.BufferRef(job="wide", buffer="w"),
        numel=4,
        num_servers=1,
        contributors=many,
        optimizer=pb.OptimizerSpec(name="sgd"),
    )
    assert call(server.address, SHARD + "RegisterBuffer", push.SerializeToString())[0].name == "OK"
    grad = pb.PushGradRequest(
        header=pb.PushGradHeader(
            ref=push.ref, chunk=pb.Chunk(numel=4, dtype=pb.FLOAT32), num_micro=1
        ),
        data=np.ones(4, np.float32).tobytes(),
    )
    code, details, _ = call(
        server.address,
        SHARD + "SetParams",
        pb.SetParamsRequest(
            header=pb.SetParamsHeader(ref=push.ref, chunk=grad.header.chunk), data=grad.data
        ).SerializeToString(),
    )
    assert code == grpc.StatusCode.OK, details
    assert call(server.address, SHARD + "PushGrad", grad.SerializeToString())[0].name == "OK"
    began = time.monotonic()
    code, details, raw = call(
        server.address, SHARD + "Status", pb.StatusRequest(pending=True).SerializeToString(), "read"
    )
    assert code == grpc.StatusCode.OK, details
    rows = {row.key: row for row in pb.StatusReply.FromString(raw).pending}
    slot, step = rows["fz:ar0/0"], rows["wide/w"]
    assert (slot.expected, list(slot.arrived), step.expected, list(step.arrived)) == (
        many,
        [0],
        many,
        [0],
    )
    assert list(slot.missing) == list(step.missing) == list(range(1, 1025))
    assert time.monotonic() - began < 2.0
    read = pb.ReadSlotRequest(key="fz:ar0/0").SerializeToString()  # times out naming who
    code, details, _ = call(server.address, SHARD + "ReadSlot", read, "train")
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "missing rank(s) 1, 2, " in details
    assert len(details) < 10_000


def test_load_replica_from_outside_the_placement_is_invalid(server: Any) -> None:
    """Was INTERNAL ValueError 'slice index 41 is outside 0..0'."""
    chunk = pb.ReplicaChunk(job="j", source_index=41, version=1, total=10, data=b"x")
    code, details, _ = call(server.address, SHARD + "LoadReplica", chunk.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "slices 0..0" in details


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("ListSnapshots", pb.ListSnapshotsRequest(job="a" * 300)),
        ("Snapshot", pb.SnapshotRequest(job="j", tag="t" * 256, num_servers=1)),
        ("CommitSnapshot", pb.CommitSnapshotRequest(job="a" * 300, tag="t", manifest_json="{}")),
        ("Restore", pb.RestoreRequest(job="j", tag="t" * 300, num_servers=1)),
    ],
)
def test_overlong_snapshot_names_are_invalid(server: Any, method: str, message: Any) -> None:
    """A job or tag longer than a file name may be was INTERNAL OSError 'File name too long'."""
    code, details, _ = call(server.address, SHARD + method, message.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "1 to 255 letters" in details


@pytest.mark.parametrize(
    "path",
    [
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    ],
)
def test_garbage_to_the_open_services_is_invalid(server: Any, path: str) -> None:
    """grpcio answered bytes its health and reflection parsers reject with INTERNAL."""
    with grpc.insecure_channel(server.address) as chan:
        if path.endswith("Check"):
            stub = chan.unary_unary(path, request_serializer=None, response_deserializer=None)
            call_ = lambda: stub(b"\x0a\x02\xff\xfe", timeout=5)  # noqa: E731
        elif path.endswith("Watch"):
            stream = chan.unary_stream(path, request_serializer=None, response_deserializer=None)
            call_ = lambda: list(stream(b"\xff" * 9, timeout=5))  # noqa: E731
        else:
            both = chan.stream_stream(path, request_serializer=None, response_deserializer=None)
            call_ = lambda: list(both(iter([b"\x0a\x02\xff\xfe"]), timeout=5))  # noqa: E731
        with pytest.raises(grpc.RpcError) as info:
            call_()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "does not parse" in info.value.details()


@pytest.mark.parametrize(
    ("key", "value", "commits"),
    [
        ("version", 2**64, False),  # committed, then every listing failed: INTERNAL
        ("created_unix", 10**400, False),  # INTERNAL OverflowError at commit
        ("cluster_servers", 2**64, True),  # a placement that does not fit: read as the default
    ],
    ids=["version", "created_unix", "cluster_servers"],
)
def test_manifest_numbers_beyond_the_wire_never_break_listing(
    server: Any, key: str, value: int, commits: bool
) -> None:
    admin = client(server.address)
    try:
        manifest = tools.snapshot(admin, "j", f"m-{key}")
    finally:
        admin.close()
    tag = f"m-{key}-2"
    folder = Path(server.servicer.snapshots.root) / "j"
    for shard in (folder / f"m-{key}").glob("shard-*"):
        (folder / tag).mkdir(exist_ok=True)
        (folder / tag / shard.name).write_bytes(shard.read_bytes())
    bad = {**manifest, "tag": tag, key: value}
    commit = pb.CommitSnapshotRequest(job="j", tag=tag, manifest_json=json.dumps(bad))
    code, details, _ = call(server.address, SHARD + "CommitSnapshot", commit.SerializeToString())
    want = grpc.StatusCode.OK if commits else grpc.StatusCode.INVALID_ARGUMENT
    assert code == want, details
    code, details, raw = call(
        server.address,
        SHARD + "ListSnapshots",
        pb.ListSnapshotsRequest(job="j").SerializeToString(),
    )
    assert code == grpc.StatusCode.OK, details
    listed = {i.tag: i for i in pb.ListSnapshotsReply.FromString(raw).snapshots}
    assert (tag in listed) == commits
    if commits:
        assert (list(listed[tag].servers), listed[tag].cluster_servers) == ([0], 1)


def test_client_tools_never_count_to_what_a_server_claims(server: Any) -> None:
    """A job restored as slice 0 of 2**31 made ``ServerJobs.placement`` build
    list(range(2**31)) in the client (the OOM killer took the fuzzer at 24 GB). Servers now
    refuse placements of more than ``MAX_SERVERS`` (65,536; tests/test_request_bounds.py), so
    the client is checked at the widest one a server can hold: a list of that many would
    take about 2.6 MB, over the bound below."""
    import tracemalloc

    from paramshard.client.jobs import server_jobs

    admin = client(server.address)
    try:
        admin.register_buffer("k", "w", 8, optimizer="sgd", hyper={"lr": 0.1})
        admin.set_params("k", "w", np.zeros(8, np.float32))
        tools.snapshot(admin, "k", "wide")
        wide = pb.RestoreRequest(job="k", tag="wide", num_servers=MAX_SERVERS)
        code, details, _ = call(server.address, SHARD + "Restore", wide.SerializeToString())
        assert code == grpc.StatusCode.OK, details
        held = server_jobs(admin)
        tracemalloc.start()
        try:
            assert held.placement("k") is None  # slice 0 of 65,536: the others are nowhere
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2**20, f"{peak:,} bytes to look at one job's placement"
        assert tools.restore(admin, "k", "wide") == 0  # back home: slice 0 of 1
    finally:
        admin.close()
