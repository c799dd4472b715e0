"""The servers of a job must share one snapshot folder: a restore reads every shard.

Before, servers whose ``--snapshot-dir``s were separate folders each wrote their shard and
committed the manifest in their own folder, so the snapshot was listed as taken and failed
only at restore, when a server was lost and the work with it. Now CommitSnapshot checks that
every shard the manifest names is in the server's folder at its size, and the snapshot fails
as it is taken, with nothing committed (server/snapshots/files.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient, tools
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb
from paramshard.server.snapshots.reservations import STALE_S

pytestmark = pytest.mark.timeout(120)
N = 10


def two_servers(servers: Any, first: Path, second: Path) -> ShardClient:
    """A client of job 'j' (one buffer of N elements) over a server writing snapshots in
    ``first`` and one writing them in ``second``."""
    (a,) = servers(1, snapshot_dir=str(first))
    (b,) = servers(1, snapshot_dir=str(second))
    c = ShardClient(ClusterSpec([a.address, b.address]), timeout_s=15, retries=0)
    c.register_buffer("j", "w", N, optimizer="sgd", hyper={"lr": 0.1})
    c.set_params("j", "w", np.arange(N, dtype=np.float32), version=1)
    return c


def test_separate_folders_fail_the_snapshot_and_commit_nothing(servers, tmp_path: Path) -> None:
    c = two_servers(servers, tmp_path / "a", tmp_path / "b")
    try:
        with pytest.raises(ShardClientError) as info:
            tools.snapshot(c, "j", "s1")
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION, info.value
        assert "must share one --snapshot-dir" in info.value.details
        assert "is missing in this server's snapshot folder" in info.value.details
        assert not list(tmp_path.rglob("manifest.json"))  # before: one in each folder
        assert tools.list_snapshots(c, "j") == []
    finally:
        c.close()


def test_one_shared_folder_commits_and_restores(servers, tmp_path: Path) -> None:
    c = two_servers(servers, tmp_path / "s", tmp_path / "s")
    try:
        manifest = tools.snapshot(c, "j", "s1")
        assert [s["server"] for s in manifest["shards"]] == [0, 1]
        for i in range(2):
            c.call(i, "Restore", pb.RestoreRequest(job="j", tag="s1", server_index=i,
                                                   num_servers=2, check_only=True))  # fmt: skip
    finally:
        c.close()


def test_a_shard_of_another_size_is_not_committed(servers, tmp_path: Path) -> None:
    """A manifest whose shard entry does not match the file there (a caller's file) is
    refused, and nothing is written."""
    (server,) = servers(1, snapshot_dir=str(tmp_path))
    c = ShardClient(ClusterSpec([server.address]), timeout_s=15, retries=0)
    try:
        c.register_buffer("j", "w", N, optimizer="sgd", hyper={"lr": 0.1})
        c.set_params("j", "w", np.arange(N, dtype=np.float32), version=1)
        manifest = tools.snapshot(c, "j", "real")
        shard = c.call(0, "Snapshot", pb.SnapshotRequest(job="j", tag="t", version=1,
                                                         num_servers=1))  # fmt: skip
        manifest["tag"] = "t"
        manifest["shards"][0].update(file=shard.file, bytes=shard.bytes + 1, sha256=shard.sha256)
        request = pb.CommitSnapshotRequest(job="j", tag="t", manifest_json=json.dumps(manifest))
        with pytest.raises(ShardClientError) as info:
            c.call(0, "CommitSnapshot", request)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION, info.value
        assert f"is {shard.bytes:,} bytes in this server's snapshot folder" in info.value.details
        assert not (tmp_path / "j" / "t" / "manifest.json").exists()
    finally:
        c.close()


def test_a_reservation_whose_server_died_is_taken_over(servers, tmp_path: Path) -> None:
    """Found in review: a server killed while its Snapshot waited left its shard's marker, and
    the tag could never be written again ("being written by another Snapshot call"), its
    partial shard file beside it. A marker names its owner now; one whose process is gone (on
    this host), or that is ``STALE_S`` old (another host's), is taken over."""
    (server,) = servers(1, snapshot_dir=str(tmp_path))
    c = ShardClient(ClusterSpec([server.address]), timeout_s=15, retries=0)
    folder = tmp_path / "j" / "t"
    marker = folder / ".shard-0-of-1.safetensors.reserved"
    host = socket.gethostname()
    try:
        c.register_buffer("j", "w", N, optimizer="sgd", hyper={"lr": 0.1})
        c.set_params("j", "w", np.arange(N, dtype=np.float32), version=1)
        folder.mkdir(parents=True)
        marker.write_text("paramshard reservation host=elsewhere pid=1\n")  # too young
        with pytest.raises(ShardClientError) as info:
            tools.snapshot(c, "j", "t")
        assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert "being written by another Snapshot call" in info.value.details
        gone = subprocess.Popen(["true"])  # a process of this host that no longer runs
        gone.wait()
        marker.write_text(f"paramshard reservation host={host} pid={gone.pid}\n")
        partial = folder / ".shard-0-of-1.safetensors.0123456789ab"
        partial.write_bytes(b"half a shard")
        assert tools.snapshot(c, "j", "t")["version"] == 1  # before: refused for good
        assert not marker.exists() and not partial.exists()
        elsewhere = tmp_path / "j" / "t2" / ".shard-0-of-1.safetensors.reserved"
        elsewhere.parent.mkdir()
        elsewhere.write_text("paramshard reservation host=elsewhere pid=1\n")
        os.utime(elsewhere, (time.time() - 2 * STALE_S,) * 2)  # another host's, long gone
        assert tools.snapshot(c, "j", "t2")["version"] == 1
        assert not elsewhere.exists()
    finally:
        c.close()
