"""Issue 13, findings 5 and 6: a committed snapshot never changes, each (tag, shard) is written
once, and one bad manifest neither commits nor breaks a listing.

Real servers on 127.0.0.1:0 sharing one snapshot folder, as N servers of a cluster do.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient, tools
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb

pytestmark = pytest.mark.timeout(120)
N = 12


def client_for(addresses: list[str], timeout_s: float = 15.0) -> ShardClient:
    return ShardClient(ClusterSpec(list(addresses)), timeout_s=timeout_s, retries=0)


def fails(c: ShardClient, method: str, request: Any) -> ShardClientError:
    with pytest.raises(ShardClientError) as info:
        c.call(0, method, request)
    assert info.value.code != grpc.StatusCode.INTERNAL, info.value.details
    return info.value


@pytest.fixture
def one(servers, tmp_path: Path) -> Any:
    """(client, snapshot root) of one server holding job 'j' at version 1."""
    root = tmp_path / "snaps"
    (server,) = servers(1, snapshot_dir=str(root))
    c = client_for([server.address])
    c.register_buffer("j", "w", N, optimizer="sgd", hyper={"lr": 0.1})
    c.set_params("j", "w", np.arange(N, dtype=np.float32), version=1)
    yield c, root
    c.close()


def snapshot_request(tag: str, version: int = 1, job: str = "j") -> pb.SnapshotRequest:
    return pb.SnapshotRequest(job=job, tag=tag, version=version, server_index=0, num_servers=1)


def commit(c: ShardClient, tag: str, manifest: Any, job: str = "j") -> Any:
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    return pb.CommitSnapshotRequest(job=job, tag=tag, manifest_json=text)


# ----------------------------------------------------------- 5: committed snapshots immutable
def test_a_committed_manifest_is_never_replaced(one) -> None:
    c, root = one
    manifest = tools.snapshot(c, "j", "t")
    path = root / "j" / "t" / "manifest.json"
    on_disk = path.read_bytes()
    # every server of a job commits the same manifest: the same bytes again are fine
    assert c.call(0, "CommitSnapshot", commit(c, "t", manifest)).path == str(path)
    other = {**manifest, "version": 7, "created_unix": manifest["created_unix"] + 1}
    err = fails(c, "CommitSnapshot", commit(c, "t", other))
    assert err.code == grpc.StatusCode.ALREADY_EXISTS and "'j/t'" in err.details
    assert path.read_bytes() == on_disk
    # nor can a shard be added to it
    err = fails(c, "Snapshot", snapshot_request("t"))
    assert err.code == grpc.StatusCode.ALREADY_EXISTS
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "manifest.json",
        "shard-0-of-1.safetensors",
    ]


def test_each_tag_and_shard_is_written_once(servers, tmp_path: Path) -> None:
    """Two servers sharing the folder both claim shard 0 of 1 of 'j' under one tag: the first
    writes it, the second gets ALREADY_EXISTS and the file stays the first's."""
    root = tmp_path / "snaps"
    nodes = servers(2, snapshot_dir=str(root))
    clients = [client_for([s.address]) for s in nodes]
    try:
        for value, c in enumerate(clients):
            c.register_buffer("j", "w", N, optimizer="sgd", hyper={"lr": 0.1})
            c.set_params("j", "w", np.full(N, value, np.float32), version=1)
        first = clients[0].call(0, "Snapshot", snapshot_request("t"))
        shard = root / "j" / "t" / "shard-0-of-1.safetensors"
        written = shard.read_bytes()
        err = fails(clients[1], "Snapshot", snapshot_request("t"))
        assert err.code == grpc.StatusCode.ALREADY_EXISTS
        assert "shard-0-of-1.safetensors" in err.details
        assert shard.read_bytes() == written and first.bytes == len(written)
        err = fails(clients[0], "Snapshot", snapshot_request("t"))  # nor the same server again
        assert err.code == grpc.StatusCode.ALREADY_EXISTS
    finally:
        for c in clients:
            c.close()


def test_a_shard_being_written_is_reserved(one) -> None:
    """A Snapshot waiting for version 5 holds (tag, shard): a second one is refused at once;
    when the first fails, the shard is free again."""
    c, root = one
    slow = client_for(c.spec.addresses, timeout_s=2.0)
    errors: list[ShardClientError] = []

    def wait_for_v5() -> None:
        try:
            slow.call(0, "Snapshot", snapshot_request("t", version=5))
        except ShardClientError as exc:
            errors.append(exc)

    waiting = threading.Thread(target=wait_for_v5)
    waiting.start()
    try:
        marker = root / "j" / "t" / ".shard-0-of-1.safetensors.reserved"
        for _ in range(100):
            if marker.exists():
                break
            time.sleep(0.02)
        err = fails(c, "Snapshot", snapshot_request("t"))
        assert err.code == grpc.StatusCode.ALREADY_EXISTS and "being written" in err.details
    finally:
        waiting.join()
        slow.close()
    assert errors and errors[0].code == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while marker.exists() and time.monotonic() < deadline:  # the server's wait ends too
        time.sleep(0.05)
    assert not marker.exists()
    assert c.call(0, "Snapshot", snapshot_request("t")).version == 1  # free again


# -------------------------------------------------------------- 6: one bad manifest
@pytest.mark.parametrize(
    "change, field",
    [
        (lambda m: m.pop("version"), "version"),
        (lambda m: m.update(version=-1), "version"),
        (lambda m: m.update(version="3"), "version"),
        (lambda m: m.update(job="other"), "job"),
        (lambda m: m.update(tag="other"), "tag"),  # only a commit: a copy keeps its tag
        (lambda m: m.pop("num_servers"), "num_servers"),
        (lambda m: m.update(shards={}), "shards"),
        (lambda m: m["shards"][0].pop("sha256"), "shards[0].sha256"),
        (lambda m: m["shards"][0].update(file="../../x"), "shards[0].file"),
        (lambda m: m.update(buffers=[]), "buffers"),
        (lambda m: m["buffers"]["w"].pop("numel"), "buffers.w.numel"),
        (lambda m: m["buffers"]["w"].pop("params"), "buffers.w.params"),
        (lambda m: m["buffers"]["w"].pop("optimizer"), "buffers.w.optimizer"),
        (lambda m: m["buffers"]["w"].update(master_dtype="float16"), "buffers.w.master_dtype"),
        (lambda m: m["buffers"]["w"]["params"].append({"nom": 1}), "buffers.w.params[0].name"),
    ],
)
def test_an_invalid_manifest_is_not_committed(one, change: Any, field: str) -> None:
    c, root = one
    manifest = tools.snapshot(c, "j", "good")
    c.call(0, "Snapshot", snapshot_request("bad"))
    bad = copy.deepcopy(manifest) | {"tag": "bad"}
    change(bad)
    err = fails(c, "CommitSnapshot", commit(c, "bad", bad))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.details and "'j/bad'" in err.details, err.details
    assert not (root / "j" / "bad" / "manifest.json").exists()
    assert [s["tag"] for s in tools.list_snapshots(c, "j")] == ["good"]


def test_an_invalid_manifest_on_disk_is_skipped_and_reported(one, caplog) -> None:
    """A manifest without a version (committed by an older server, or by hand): every job's
    listing and 'latest' go on without it; the server logs it once."""
    c, root = one
    manifest = tools.snapshot(c, "j", "good")
    c.register_buffer("k", "w", N, optimizer="sgd", hyper={"lr": 0.1})
    c.set_params("k", "w", np.ones(N, np.float32), version=2)
    tools.snapshot(c, "k", "other-job")
    c.call(0, "Snapshot", snapshot_request("newer", version=1))
    bad = {key: value for key, value in manifest.items() if key != "version"} | {"tag": "newer"}
    (root / "j" / "newer" / "manifest.json").write_text(json.dumps(bad))
    with caplog.at_level(logging.WARNING, logger="paramshard.snapshots"):
        for _ in range(2):
            listed = c.call(0, "ListSnapshots", pb.ListSnapshotsRequest()).snapshots
            assert sorted((s.job, s.tag) for s in listed) == [("j", "good"), ("k", "other-job")]
            assert [
                s.tag
                for s in c.call(0, "ListSnapshots", pb.ListSnapshotsRequest(job="j")).snapshots
            ] == ["good"]
    reports = [r for r in caplog.records if "j/newer/manifest.json" in r.getMessage()]
    assert len(reports) == 1 and "version" in reports[0].getMessage()
    assert tools.restore(c, "j", "latest") == 1
    err = fails(c, "Restore", pb.RestoreRequest(job="j", tag="newer", num_servers=1))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and "version" in err.details
