"""Snapshots never follow a symbolic link out of the snapshot directory (issue 27, finding 8;
server/snapshots/folders.py, server/snapshots/files.py).

Before: a tag folder planted as a symlink to a folder outside the snapshot directory, and
``Snapshot`` and ``CommitSnapshot`` returned OK with the shard and the manifest written outside.
Now every folder and file under the root is opened without following links: writes and reads
(Restore, ListSnapshots) through one are refused with FAILED_PRECONDITION naming it, nothing is
written outside, and the job's parameters are as they were.
"""

from __future__ import annotations

import json
import os
import shutil
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
VALUES = np.arange(N, dtype=np.float32)


@pytest.fixture
def planted(servers, tmp_path: Path) -> Any:
    """(client, root, outside): job 'j' at version 1 with a complete snapshot 'real'; an
    empty folder ``outside`` the snapshot directory."""
    root, outside = tmp_path / "snaps", tmp_path / "outside"
    outside.mkdir()
    (server,) = servers(1, snapshot_dir=str(root))
    c = ShardClient(ClusterSpec([server.address]), timeout_s=15, retries=0)
    c.register_buffer("j", "w", N, optimizer="sgd", hyper={"lr": 0.1})
    c.set_params("j", "w", VALUES, version=1)
    tools.snapshot(c, "j", "real")
    yield c, root, outside
    c.close()


def refused(c: ShardClient, method: str, request: Any) -> str:
    with pytest.raises(ShardClientError) as info:
        c.call(0, method, request)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION, (
        info.value.code,
        info.value.details,
    )
    assert "symbolic link" in info.value.details, info.value.details
    return info.value.details


def unchanged(c: ShardClient, outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == [], "written outside the snapshot folder"
    np.testing.assert_array_equal(c.pull_params("j", "w", N), VALUES)
    (row,) = [job for job in c.status()[0]["jobs"] if job["job"] == "j"]
    assert int(row["buffers"][0]["version"]) == 1


def snapshot(tag: str, job: str = "j") -> pb.SnapshotRequest:
    return pb.SnapshotRequest(job=job, tag=tag, version=1, server_index=0, num_servers=1)


def test_writes_through_a_planted_tag_link_are_refused(planted) -> None:
    c, root, outside = planted
    (root / "j" / "evil").symlink_to(outside, target_is_directory=True)
    details = refused(c, "Snapshot", snapshot("evil"))
    assert "j/evil" in details
    manifest = json.loads((root / "j" / "real" / "manifest.json").read_text())
    text = json.dumps({**manifest, "tag": "evil"})
    refused(c, "CommitSnapshot", pb.CommitSnapshotRequest(job="j", tag="evil", manifest_json=text))
    unchanged(c, outside)


def test_writes_through_a_planted_job_link_are_refused(planted) -> None:
    c, root, outside = planted
    c.register_buffer("k", "w", N, optimizer="sgd", hyper={"lr": 0.1})
    c.set_params("k", "w", VALUES, version=1)
    (root / "k").symlink_to(outside, target_is_directory=True)
    assert "/k " in refused(c, "Snapshot", snapshot("t", job="k"))
    unchanged(c, outside)


def test_a_planted_manifest_or_shard_link_is_never_written_through(planted) -> None:
    """A tag folder of its own holding a link named like the manifest (or the shard) to a file
    outside: the write refuses to replace it, and the file outside stays as it was."""
    c, root, outside = planted
    target = outside / "target"
    (root / "j" / "t").mkdir()
    (root / "j" / "t" / "shard-0-of-1.safetensors").symlink_to(target)
    with pytest.raises(ShardClientError) as info:
        c.call(0, "Snapshot", snapshot("t"))
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS, info.value.details
    (root / "j" / "u").mkdir()
    (root / "j" / "u" / "manifest.json").symlink_to(target)
    with pytest.raises(ShardClientError) as info:
        c.call(0, "Snapshot", snapshot("u"))
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS, info.value.details
    assert not target.exists()
    unchanged(c, outside)


def test_reads_through_a_link_are_refused_and_not_listed(planted) -> None:
    """A complete snapshot moved outside and linked back under a tag; a real tag whose shard
    file is a link to a copy outside: Restore refuses both, ListSnapshots lists neither."""
    c, root, outside = planted
    moved = outside / "moved"
    shutil.copytree(root / "j" / "real", moved)
    (root / "j" / "linked").symlink_to(moved, target_is_directory=True)
    shutil.copytree(root / "j" / "real", root / "j" / "shardlink")
    shard = root / "j" / "shardlink" / "shard-0-of-1.safetensors"
    shutil.copy(shard, outside / "shard")
    shard.unlink()
    shard.symlink_to(outside / "shard")
    before = sorted(os.listdir(outside))
    c.set_params("j", "w", VALUES + 1, version=1)  # what a restore would overwrite
    for tag in ("linked", "shardlink"):
        request = pb.RestoreRequest(job="j", tag=tag, server_index=0, num_servers=1)
        refused(c, "Restore", request)
        np.testing.assert_array_equal(c.pull_params("j", "w", N), VALUES + 1)
    listed = c.call(0, "ListSnapshots", pb.ListSnapshotsRequest(job="j")).snapshots
    assert [s.tag for s in listed] == ["real"]
    everything = c.call(0, "ListSnapshots", pb.ListSnapshotsRequest()).snapshots
    assert [s.tag for s in everything] == ["real"]
    (root / "alias").symlink_to(root / "j", target_is_directory=True)  # a job folder link
    everything = c.call(0, "ListSnapshots", pb.ListSnapshotsRequest()).snapshots
    assert [(s.job, s.tag) for s in everything] == [("j", "real")]
    refused(c, "ListSnapshots", pb.ListSnapshotsRequest(job="alias"))
    assert sorted(os.listdir(outside)) == before
    # the real snapshot still restores
    c.call(0, "Restore", pb.RestoreRequest(job="j", tag="real", server_index=0, num_servers=1))
    np.testing.assert_array_equal(c.pull_params("j", "w", N), VALUES)
