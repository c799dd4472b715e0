"""Hostile snapshot folders the server already refused (docs/security.md, seventeenth round),
probed where no other test does: FIFOs, folders and device links in place of a file, planted
manifests that lie in their fields, deletion during a restore and a restore of a tag being
written. After each call: no INTERNAL or UNKNOWN, a message saying what was wrong, bounded
time, and the job and the memory account as they were. Helpers: tests/snapshot_probes.py."""

from __future__ import annotations

import os
import threading
import time

import pytest
from replica_probes import Code, call, refused, state
from snapshot_probes import (
    SHARD,
    cli,
    listed,
    one_line_error,
    plant,
    restore,
    snapshot_server,
)

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb
from paramshard.server.snapshots import files


@pytest.fixture
def planted(servers, tmp_path):
    """(server, snapshot root): job 'j' and its complete snapshot 't1'."""
    root = tmp_path / "snaps"
    return snapshot_server(servers, root), root


ONCE = "shards must list each of the num_servers = 1 shards once"


def _link_to_dev_zero(path) -> None:
    path.symlink_to("/dev/zero")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("what", ["manifest.json", SHARD])
@pytest.mark.parametrize("kind", ["fifo", "folder", "link to /dev/zero"])
def test_a_fifo_folder_or_device_link_in_place_of_a_file_is_refused(planted, tmp_path, what, kind):
    """Nothing blocks on a FIFO (opened O_NONBLOCK, then refused as not a plain file), reads a
    folder, or follows a link to /dev/zero: Restore, the listings (a torn tag of a FIFO shard
    too) and the offline export refuse it at once, naming it."""
    node, root = planted
    folder = plant(root, "odd")
    path = folder / what
    path.unlink()
    make = {"fifo": os.mkfifo, "folder": os.mkdir, "link to /dev/zero": _link_to_dev_zero}
    make[kind](path)
    torn = root / "j" / "torn"
    torn.mkdir()
    os.mkfifo(torn / SHARD)
    before = state(node)
    try:
        began = time.monotonic()
        details = refused(node.address, "Restore", restore("odd"), Code.FAILED_PRECONDITION)
        assert what in details
        assert listed(node.address, torn=True) == ["t1"]
        assert time.monotonic() - began < 10
        rc, err, _ = cli("export", "--snapshot", str(folder), "--out", str(tmp_path / "o"))
        one_line_error(rc, err, "export")
        assert state(node) == before
    finally:  # the FIFOs and the link go
        (torn / SHARD).unlink()
        path.rmdir() if kind == "folder" else path.unlink()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "change, code, named",
    [
        (lambda m: m.update(job="k"), Code.FAILED_PRECONDITION, "job is 'k'"),
        (lambda m: m.update(version=True), Code.FAILED_PRECONDITION, "version"),
        (lambda m: m["shards"][0].update(bytes=-1), Code.FAILED_PRECONDITION, "bytes"),
        (lambda m: m["shards"][0].update(file=".."), Code.FAILED_PRECONDITION, ONCE),
        (lambda m: m["shards"][0].update(file="/etc/passwd"), Code.FAILED_PRECONDITION, ONCE),
        (lambda m: m.update(format="x" * 2**20), Code.FAILED_PRECONDITION, "characters cut"),
        ("{nope", Code.FAILED_PRECONDITION, "corrupt"),
        ("[" * 100_000 + "]" * 100_000, Code.FAILED_PRECONDITION, "recursion"),
    ],
)
def test_a_planted_manifest_is_refused_naming_what_is_wrong(planted, change, code, named) -> None:
    """Restore reads a planted manifest as hostile: its shards must be the slices' own, each
    named once (``..`` or ``/etc/passwd`` is no shard of this snapshot), a 1 MiB value quoted
    in the message is clipped, and a manifest that is not JSON, or nested 100,000 deep, is
    corrupt."""
    node, root = planted
    folder = plant(root, "odd", change=None if isinstance(change, str) else change)
    if isinstance(change, str):
        (folder / "manifest.json").write_text(change)
    before = state(node)
    details = refused(node.address, "Restore", restore("odd"), code)
    assert named in details and len(details) < 4096, details[:300]
    assert listed(node.address, job="j") == ["t1"]
    assert state(node) == before


@pytest.mark.timeout(90)
def test_a_tag_being_restored_is_not_deleted_and_one_being_written_is_not_restored(
    planted, monkeypatch
) -> None:
    """DeleteSnapshot while a Restore of the tag reads its shards: refused ("in use"), and the
    restore completes from whole files. Restore of a tag a Snapshot is still writing (waiting
    for a later version, its shard reserved): NOT_FOUND, the job unchanged; the Snapshot ends
    at its deadline and the memory account is back where it was."""
    node, root = planted
    reading, go = threading.Event(), threading.Event()
    digest = files._digest

    def slow_digest(folder, name, expected):
        reading.set()
        go.wait(20)
        return digest(folder, name, expected)

    monkeypatch.setattr(files, "_digest", slow_digest)
    before = state(node)
    done: list[object] = []
    restoring = threading.Thread(
        target=lambda: done.append(call(node.address, "Restore", restore("t1")))
    )
    restoring.start()
    try:
        assert reading.wait(20)
        delete = pb.DeleteSnapshotRequest(job="j", tag="t1")
        details = refused(node.address, "DeleteSnapshot", delete, Code.FAILED_PRECONDITION)
        assert "in use" in details
    finally:
        go.set()
        restoring.join(30)
    assert isinstance(done[0], pb.RestoreReply), done
    assert sorted(p.name for p in (root / "j" / "t1").iterdir()) == ["manifest.json", SHARD]
    monkeypatch.setattr(files, "_digest", digest)
    snap = pb.SnapshotRequest(job="j", tag="w", version=5, server_index=0, num_servers=1)
    waiter = ShardClient(ClusterSpec([node.address], token="admin-secret"), timeout_s=3, retries=0)

    def write() -> None:
        try:
            done.append(waiter.call(0, "Snapshot", snap))
        except ShardClientError as exc:
            done.append(exc.code)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(200):
            if (root / "j" / "w" / f".{SHARD}.reserved").exists():
                break
            time.sleep(0.05)
        assert "manifest.json" in refused(node.address, "Restore", restore("w"), Code.NOT_FOUND)
    finally:
        writer.join(60)
        waiter.close()
    assert done[1] == Code.DEADLINE_EXCEEDED, done
    assert state(node) == before
