"""Deleting snapshots (``DeleteSnapshot``, ``tools.delete_snapshot`` / ``prune_snapshots``,
``paramshard delete-snapshot``). Before, nothing removed a snapshot: a job that snapshots every
few hundred steps filled its disk, and a torn tag (shards, no manifest) stayed for good.

Real in-process servers sharing the test's snapshot folder, as servers share one (NFS).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from contextlib import closing
from pathlib import Path

import grpc
import numpy as np
import pytest

from paramshard.cli import main
from paramshard.client import (
    ClusterSpec,
    ParamInfo,
    ShardClient,
    ShardClientError,
    StepArgs,
    tools,
)
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer

pytestmark = pytest.mark.timeout(120)
N = 100


@pytest.fixture
def two(servers, tmp_path: Path):
    """A client of SGD job 'j' on two servers sharing folder ``tmp_path``, at version 0."""
    nodes = servers(2, snapshot_dir=str(tmp_path))
    c = ShardClient(ClusterSpec([s.address for s in nodes]), timeout_s=15, retries=0)
    c.register_buffer("j", "w", N, params=[ParamInfo("w", (N,), 0)], optimizer="sgd",
                      hyper={"lr": 0.1})  # fmt: skip
    c.set_params("j", "w", np.zeros(N, np.float32))
    yield c, nodes, tmp_path
    c.close()


def step(c: ShardClient, version: int) -> None:
    c.push_grads("j", "w", np.ones(N, np.float32), step=version)
    c.step("j", version, {"w": StepArgs({"lr": 0.1})})


def refused(c: ShardClient, code: grpc.StatusCode, job: str, tag: str) -> str:
    with pytest.raises(ShardClientError) as err:
        c.call(0, "DeleteSnapshot", pb.DeleteSnapshotRequest(job=job, tag=tag))
    assert err.value.code == code, err.value
    return err.value.details


def tags(c: ShardClient) -> list[str]:
    return [r["tag"] for r in tools.list_snapshots(c, "j")]


def test_a_deleted_snapshot_is_gone_from_listings_disk_and_restores(two) -> None:
    c, _, root = two
    tools.snapshot(c, "j", "t1")
    step(c, 0)
    tools.snapshot(c, "j", "t2")
    size = sum(p.stat().st_size for p in (root / "j" / "t1").iterdir())
    done = tools.delete_snapshot(c, "j", "t1")
    assert (done["files"], done["bytes"], done["complete"]) == (3, size, True), done
    assert tags(c) == ["t2"] and sorted(os.listdir(root / "j")) == ["t2"]
    with pytest.raises(ShardClientError, match="NOT_FOUND"):
        tools.restore(c, "j", "t1")
    assert tools.restore(c, "j", "latest") == 1  # what is left is whole
    with pytest.raises(KeyError, match="no snapshot 't1' on any server"):
        tools.delete_snapshot(c, "j", "t1")


def test_a_torn_tag_is_deleted_and_can_be_taken_again(two) -> None:
    """A failed attempt's shard (no manifest, listed nowhere) blocked its tag for good."""
    c, _, root = two
    c.call(0, "Snapshot", pb.SnapshotRequest(job="j", tag="t", version=0, num_servers=2))
    with pytest.raises(ShardClientError, match="was not committed"):
        tools.snapshot(c, "j", "t")  # the same version: that shard may yet be committed
    assert tags(c) == [] and (root / "j" / "t").is_dir()
    done = tools.delete_snapshot(c, "j", "t")
    assert (done["complete"], done["files"]) == (False, 2), done  # both servers' shards
    assert not (root / "j" / "t").exists()
    assert tools.snapshot(c, "j", "t")["version"] == 0 and tags(c) == ["t"]


def test_a_tag_in_use_is_refused_and_left_whole(two) -> None:
    """A Snapshot waiting for its version holds the tag on its server; a marker of a live
    process (another server's call in the shared folder) holds it for every server."""
    c, nodes, root = two
    waiter = ShardClient(c.spec, timeout_s=3, retries=0)
    ended: list[BaseException] = []

    def wait_for_version_3() -> None:
        request = pb.SnapshotRequest(job="j", tag="w", version=3, num_servers=2)
        try:
            waiter.call(0, "Snapshot", request)
        except ShardClientError as exc:
            ended.append(exc)

    waiting = threading.Thread(target=wait_for_version_3)
    waiting.start()
    try:
        for _ in range(200):  # its marker is written as the call begins
            if (root / "j" / "w" / ".shard-0-of-2.safetensors.reserved").exists():
                break
            threading.Event().wait(0.02)
        details = refused(c, grpc.StatusCode.FAILED_PRECONDITION, "j", "w")
        assert "is in use on this server" in details, details
    finally:
        waiting.join(30)
        waiter.close()
    assert ended and ended[0].code == grpc.StatusCode.DEADLINE_EXCEEDED, ended
    tools.snapshot(c, "j", "s")
    folder = root / "j" / "s"
    before = sorted(p.name for p in folder.iterdir())
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        marker = folder / ".shard-1-of-2.safetensors.reserved"
        marker.write_text(
            f"paramshard reservation host={os.uname().nodename} pid={live.pid} process=x call=y\n"
        )
        details = refused(c, grpc.StatusCode.FAILED_PRECONDITION, "j", "s")
        assert "shard shard-1-of-2.safetensors is being written" in details, details
        assert sorted(p.name for p in folder.iterdir()) == sorted([*before, marker.name])
    finally:
        live.kill()
        live.wait()
    done = tools.delete_snapshot(c, "j", "s")  # the marker's process is gone: it goes too
    assert done["files"] == 3 and not folder.exists(), done


def test_what_no_snapshot_writes_is_left_in_place(two, tmp_path_factory) -> None:
    c, _, root = two
    tools.snapshot(c, "j", "t")
    outside = tmp_path_factory.mktemp("outside")
    (outside / "precious").write_text("keep")
    folder = root / "j" / "t"
    (folder / "notes.txt").write_text("mine")
    (folder / "sub").mkdir()
    os.symlink(outside / "precious", folder / "shard-9-of-10.safetensors")  # our name, a link
    (folder / ".my-lock.reserved").write_text("not a Snapshot's marker")
    (folder / "..shard-0-of-2.safetensors.reserved.0123456789ab").write_text("a marker's write")
    done = tools.delete_snapshot(c, "j", "t")
    assert done["complete"] and done["files"] == 4, done
    kept = [".my-lock.reserved", "notes.txt", "shard-9-of-10.safetensors", "sub"]
    assert done["kept"] == kept and sorted(os.listdir(folder)) == kept
    assert (outside / "precious").read_text() == "keep" and tags(c) == []


def test_a_reply_names_at_most_100_entries_kept(two) -> None:
    c, _, root = two
    tools.snapshot(c, "j", "t")
    for i in range(150):
        (root / "j" / "t" / f"{i:03d}-{'y' * 240}").write_text("")
    done = tools.delete_snapshot(c, "j", "t")
    assert len(done["kept"]) == 101 and done["kept"][-1] == "... and 50 more", done["kept"][-3:]
    assert done["kept"][0].startswith("000-") and done["kept"][99].startswith("099-")


def test_bad_requests_are_refused_and_change_nothing(two, servers, tmp_path_factory) -> None:
    c, _, root = two
    tools.snapshot(c, "j", "t")
    before = sorted(str(p) for p in root.rglob("*"))
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert "'latest' is resolved only when restoring" in refused(c, invalid, "j", "latest")
    for job, tag in [("..", "t"), ("j", ".."), ("j", "a/b"), ("j", "x" * 300), ("", "t")]:
        refused(c, invalid, job, tag)
    outside = tmp_path_factory.mktemp("elsewhere")
    (outside / "manifest.json").write_text("{}")
    os.symlink(outside, root / "j" / "link")
    (root / "j" / "file").write_text("x")
    before = sorted(str(p) for p in root.rglob("*"))
    for tag in ("link", "file"):
        details = refused(c, grpc.StatusCode.FAILED_PRECONDITION, "j", tag)
        assert "a symbolic link or not a folder" in details, details
    assert sorted(str(p) for p in root.rglob("*")) == before
    assert (outside / "manifest.json").read_text() == "{}" and tags(c) == ["t"]
    reply = c.call(0, "DeleteSnapshot", pb.DeleteSnapshotRequest(job="other", tag="t"))
    assert not reply.found
    (bare,) = servers(1)
    with closing(ShardClient(ClusterSpec([bare.address]), timeout_s=10, retries=0)) as plain:
        details = refused(plain, grpc.StatusCode.FAILED_PRECONDITION, "j", "t")
        assert "no snapshot directory" in details, details


def test_only_admin_tokens_in_scope_delete(tmp_path: Path) -> None:
    tokens = {"root": "admin", "t": "train", "r": "read", "other": "admin jobs=other-*"}
    s = ShardServer("127.0.0.1", 0, tokens=tokens, snapshot_dir=str(tmp_path)).start()
    try:
        with closing(ShardClient(ClusterSpec([s.address], token="root"), timeout_s=10)) as root:
            root.register_buffer("j", "w", N, params=[ParamInfo("w", (N,), 0)])
            root.set_params("j", "w", np.zeros(N, np.float32))
            tools.snapshot(root, "j", "t")
        for token in ("t", "r", "other"):
            with closing(ShardClient(ClusterSpec([s.address], token=token), timeout_s=10)) as c:
                refused(c, grpc.StatusCode.PERMISSION_DENIED, "j", "t")
        assert (tmp_path / "j" / "t" / "manifest.json").is_file()
    finally:
        s.stop(0)


def test_prune_keeps_the_last_taken_and_tags_of_other_names(two) -> None:
    c, _, _ = two
    for v, tag in enumerate(["auto-0", "mine", "auto-2", "auto-2-e1", "autox-3", "auto-2.1"]):
        tools.snapshot(c, "j", tag)
        step(c, v)
    gone = tools.prune_snapshots(c, "j", keep_last=2, prefix="auto")
    assert [g["tag"] for g in gone] == ["auto-0", "auto-2"]
    assert tags(c) == ["mine", "auto-2-e1", "autox-3", "auto-2.1"]
    assert [g["tag"] for g in tools.prune_snapshots(c, "j", keep_last=1)] == [
        "mine",
        "auto-2-e1",
        "autox-3",
    ]  # no prefix: every tag
    assert tags(c) == ["auto-2.1"]
    with pytest.raises(ValueError, match="at least 1"):
        tools.prune_snapshots(c, "j", keep_last=0)


def test_a_prune_lists_the_snapshots_twice_however_many_it_deletes(two, monkeypatch) -> None:
    """A prune lists once to choose and once to find each tag's folders. Before, each deletion
    listed again: 1 + n listings for n tags (after every checkpoint of a long run)."""
    c, _, _ = two
    for v in range(5):
        tools.snapshot(c, "j", f"auto-{v}")
        step(c, v)
    asked: list[str] = []
    call = c.call
    monkeypatch.setattr(c, "call", lambda s, m, r: asked.append(m) or call(s, m, r))
    gone = tools.prune_snapshots(c, "j", keep_last=1, prefix="auto")
    assert [g["tag"] for g in gone] == ["auto-0", "auto-1", "auto-2", "auto-3"]
    assert asked.count("ListSnapshots") == 2, asked
    assert tags(c) == ["auto-4"]


def test_a_prune_of_a_job_with_no_snapshot_says_so(two, capsys) -> None:
    """A mistyped job name: the command failed to say so ("nothing to delete", exit 0)."""
    c, nodes, _ = two
    with pytest.raises(KeyError, match="job 'k' has no snapshot"):
        tools.prune_snapshots(c, "k", keep_last=1)
    servers = ",".join(s.address for s in nodes)
    assert main(["delete-snapshot", "k", "--keep-last", "1", "--servers", servers]) == 1
    assert "job 'k' has no snapshot on the servers" in capsys.readouterr().err


def test_the_command(two, capsys) -> None:
    c, nodes, _ = two
    servers = ",".join(s.address for s in nodes)
    for v, tag in enumerate(["a-0", "a-1", "a-2", "b"]):
        tools.snapshot(c, "j", tag)
        step(c, v)
    assert main(["delete-snapshot", "j", "--tag", "b", "--servers", servers]) == 0
    assert "deleted j/b: 3 files" in capsys.readouterr().out
    args = ["delete-snapshot", "j", "--keep-last", "1", "--prefix", "a", "--servers", servers]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "deleted j/a-0" in out and "deleted j/a-1" in out and tags(c) == ["a-2"]
    assert main(args) == 0 and "nothing to delete" in capsys.readouterr().out
    assert main(["delete-snapshot", "j", "--tag", "gone", "--servers", servers]) == 1
    assert "no snapshot 'gone'" in capsys.readouterr().err
    tools.snapshot(c, "j", "c")
    tools.snapshot(c, "j", "d")
    # each tag on its own: a missing one stops no other, and says which
    assert (
        main(
            [
                "delete-snapshot",
                "j",
                *"--tag c --tag gone --tag d --tag d".split(),
                "--servers",
                servers,
            ]
        )
        == 1
    )
    said = capsys.readouterr()
    assert "deleted j/c: 3 files" in said.out and "deleted j/d: 3 files" in said.out
    assert "no snapshot 'gone'" in said.err and "'d'" not in said.err
    for bad in (
        ["j"],
        ["j", "--tag", "a-2", "--keep-last", "1"],
        ["j", "--tag", "x", "--prefix", "a"],
    ):
        assert main(["delete-snapshot", *bad, "--servers", servers]) == 2
    with pytest.raises(SystemExit):  # argparse: K is at least 1
        main(["delete-snapshot", "j", "--keep-last", "0", "--servers", servers])
    assert tags(c) == ["a-2"]


def torn(c: ShardClient, tag: str, version: int) -> None:
    """Server 0's shard of ``tag`` written, nothing committed: a torn tag."""
    c.call(0, "Snapshot", pb.SnapshotRequest(job="j", tag=tag, version=version, num_servers=2))


def test_torn_tags_are_listed_when_asked_and_pruned_once_older(two, capsys) -> None:
    c, nodes, _ = two
    torn(c, "auto-0", 0)
    assert tools.list_snapshots(c, "j") == []
    (row,) = tools.list_snapshots(c, "j", torn=True)
    assert (row["tag"], row["torn"], row["version"], row["num_servers"]) == ("auto-0", True, 0, 2)
    step(c, 0)
    tools.snapshot(c, "j", "auto-1")
    step(c, 1)
    torn(c, "auto-2", 2)  # newer than every complete one: may be under way, kept
    listed = [(r["tag"], bool(r.get("torn"))) for r in tools.list_snapshots(c, "j", torn=True)]
    assert listed == [("auto-1", False), ("auto-0", True), ("auto-2", True)]
    servers = ",".join(s.address for s in nodes)
    assert main(["snapshots", "j", "--torn", "--servers", servers]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "STATE" and lines[2].split() == [
        "j",
        "auto-0",
        "0",
        "2",
        "1",
        "torn",
    ]
    gone = tools.prune_snapshots(c, "j", keep_last=1, prefix="auto")
    assert [(g["tag"], g["complete"]) for g in gone] == [("auto-0", False)]
    listed = [(r["tag"], bool(r.get("torn"))) for r in tools.list_snapshots(c, "j", torn=True)]
    assert listed == [("auto-1", False), ("auto-2", True)]


def test_a_tag_a_restore_checked_on_another_server_is_kept_whole(two) -> None:
    """The servers share one folder: server 0 would remove the files while server 1, which
    checked a restore of the tag (phase one) and is about to load it, refused. Every server
    is asked first now, and a restore's check holds its tag until it loads."""
    c, _, root = two
    tools.snapshot(c, "j", "t")
    files = sorted(os.listdir(root / "j" / "t"))
    check = pb.RestoreRequest(job="j", tag="t", server_index=1, num_servers=2, check_only=True)
    c.call(1, "Restore", check)
    with pytest.raises(ShardClientError, match="a restore of snapshot 'j/t' was checked") as err:
        tools.delete_snapshot(c, "j", "t")
    assert err.value.server == 1 and sorted(os.listdir(root / "j" / "t")) == files
    load = pb.RestoreRequest(job="j", tag="t", server_index=1, num_servers=2)
    c.call(1, "Restore", load)  # loaded: the hold ends
    assert tools.delete_snapshot(c, "j", "t")["files"] == 3


def test_a_3d_jobs_torn_tag_never_outlives_its_last_whole_one(servers, tmp_path) -> None:
    """A tag that one part committed and another did not (a server lost during the commit)
    was listed as a whole snapshot: pruning kept it, the newest, and deleted every snapshot
    that would restore. Deleting a fully torn tag by the base name once the servers no
    longer hold the job found nothing."""
    nodes = servers(2, snapshot_dir=str(tmp_path))
    c = ShardClient(ClusterSpec([s.address for s in nodes]), timeout_s=15, retries=0)
    parts = ["m.pp0.tp0", "m.pp1.tp0"]
    try:
        for job in parts:
            c.register_buffer(job, "w", N, params=[ParamInfo("w", (N,), 0)])
            c.set_params(job, "w", np.zeros(N, np.float32))
        for tag in ("a", "b", "half", "none"):
            tools.snapshot(c, "m", tag)
        os.unlink(tmp_path / parts[1] / "half" / "manifest.json")  # its commit never came
        for part in parts:
            os.unlink(tmp_path / part / "none" / "manifest.json")
        assert [r["tag"] for r in tools.list_snapshots(c, "m", combine_parts=True)] == [
            "a",
            "b",
            "half",  # pp0's alone, under the part's name
        ]
        assert [g["tag"] for g in tools.prune_snapshots(c, "m", keep_last=1)] == ["a"]
        assert tools.restore(c, "m", "b") == 0
        for job in parts:
            c.call(0, "DropJob", pb.DropJobRequest(job=job))
            c.call(1, "DropJob", pb.DropJobRequest(job=job))
        done = tools.delete_snapshot(c, "m", "none")
        assert (done["jobs"], done["files"], done["complete"]) == (parts, 4, False), done
        assert sorted(os.listdir(tmp_path / parts[1])) == ["b", "half"]
    finally:
        c.close()
