"""Snapshots: bugs tests/test_snapshots.py's suite found, fixed (docs/design.md §5.1).
``load_checkpoint`` waits for every rank; a step between the snapshot's status read and its
capture; listing refuses names that leave the directory and skips a foreign manifest; a failed
snapshot keeps the one under its tag; a restore failing on one server loads nothing.

Real in-process servers and a real tiny GPT (tests/snapshot_job.py), float64.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import grpc
import pytest
from conftest import run_ranks
from snapshot_job import (
    SNAP_AT,
    STEPS,
    WORLD,
    assert_same,
    batches,
    client_for,
    code_of,
    initial_weights,
    one_rank,
    snapshot_servers,
    train_job,
    train_steps,
    versions_of,
    wrap,
)

from paramshard.client import ShardClient, ShardClientError, tools
from paramshard.server.snapshots.files import SnapshotDir


def test_load_checkpoint_waits_for_every_rank(servers, tmp_path, monkeypatch):
    """The documented flow: every rank builds its wrappers, then calls load_checkpoint. Here
    rank 1 is slower to register (deterministically: it pauses after its first buffer)."""
    import threading

    root = tmp_path / "snaps"
    addresses, job, final, _ = train_job(servers, 2, root, "fsdp")
    init, data = initial_weights(), batches()
    first_registered, restored = threading.Event(), threading.Event()
    real_restore = tools.restore

    def restore(*a: Any, **kw: Any) -> int:
        out = real_restore(*a, **kw)
        restored.set()
        return out

    monkeypatch.setattr(tools, "restore", restore)

    def rank(client: ShardClient) -> dict:
        if client.rank == 1:
            real_register, count = client.register_buffer, []

            def register(*a: Any, **kw: Any) -> Any:
                out = real_register(*a, **kw)
                count.append(1)
                if len(count) == 1:
                    first_registered.set()
                    restored.wait(3.0)  # with the fix, rank 0 waits for us instead
                return out

            client.register_buffer = register
        model, opt = wrap("fsdp", client, job, init)
        if client.rank == 0:
            first_registered.wait(10.0)
        assert model.load_checkpoint("k") == SNAP_AT
        train_steps(model, opt, client.rank, WORLD, data, range(SNAP_AT, STEPS))
        return model.state_dict()

    assert_same(run_ranks(rank, WORLD, addresses)[0], final)


def test_snapshot_survives_a_step_between_status_and_capture(servers, tmp_path):
    root = tmp_path / "snaps"
    addresses = [s.address for s in snapshot_servers(servers, 2, root)]
    job, trainer, model, opt, data = one_rank(addresses, 2)
    snapper = client_for(addresses)
    real_run, stepped = snapper.run, []

    def run(calls: Any) -> Any:  # training goes on while the snapshot is being requested
        calls = list(calls)
        if not stepped and calls[0].method == "Snapshot":
            stepped.append(1)
            train_steps(model, opt, 0, 1, data, range(2, 3))
        return real_run(calls)

    snapper.run = run
    try:
        manifest = tools.snapshot(snapper, job, "t")
        assert manifest["version"] in (2, 3)
    finally:
        snapper.close()
        trainer.close()


SHARD = "shard-0-of-1.safetensors"


def _manifest(job: str, tag: str) -> dict:
    return {
        "format": "paramshard-snapshot/1",
        "job": job,
        "tag": tag,
        "version": 0,
        "num_servers": 1,
        "created_unix": 0.0,
        "buffers": {},
        # a manifest lists its slices' shards, each once (docs/security.md 144)
        "shards": [{"file": SHARD, "bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}],
    }


def test_list_snapshots_refuses_names_leaving_the_directory(servers, tmp_path):
    root = tmp_path / "snaps"
    root.mkdir()
    (tmp_path / "outside" / "t").mkdir(parents=True)
    (tmp_path / "outside" / "t" / "manifest.json").write_text(json.dumps(_manifest("x", "t")))
    c = client_for([s.address for s in snapshot_servers(servers, 1, root)])
    try:
        with pytest.raises(ShardClientError) as excinfo:
            tools.list_snapshots(c, "../outside")
        assert code_of(excinfo) == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        c.close()


def test_a_foreign_manifest_does_not_break_listing(servers, tmp_path):
    root = tmp_path / "snaps"
    good = root / "j" / "good"
    good.mkdir(parents=True)
    (good / "manifest.json").write_text(json.dumps(_manifest("j", "good")))
    (good / SHARD).write_bytes(b"")
    (root / "j" / "stray").mkdir()
    (root / "j" / "stray" / "manifest.json").write_text("{}")
    c = client_for([s.address for s in snapshot_servers(servers, 1, root)])
    try:
        assert [s["tag"] for s in tools.list_snapshots(c, "j")] == ["good"]
        with pytest.raises(ShardClientError) as excinfo:
            tools.restore(c, "j", "stray")
        assert code_of(excinfo) == grpc.StatusCode.FAILED_PRECONDITION
        assert str(root / "j" / "stray" / "manifest.json") in excinfo.value.details
    finally:
        c.close()


def test_a_failed_snapshot_does_not_destroy_one_under_the_same_tag(servers, tmp_path):
    root = tmp_path / "snaps"
    nodes = snapshot_servers(servers, 2, root)
    addresses = [s.address for s in nodes]
    job, trainer, model, opt, data = one_rank(addresses, 1)
    c = client_for(addresses)
    try:
        tools.snapshot(c, job, "dup")
        train_steps(model, opt, 0, 1, data, range(1, 2))

        def disk_full(*a: Any, **kw: Any) -> Any:
            raise OSError(28, "No space left on device")

        nodes[1].servicer.snapshots.write_shard = disk_full
        with pytest.raises(ShardClientError):
            tools.snapshot(c, job, "dup")
        listed = [s["tag"] for s in tools.list_snapshots(c, job)]
        if "dup" in listed:  # still listed: then it must still restore
            assert tools.restore(c, job, "dup") == 1
    finally:
        c.close()
        trainer.close()


def test_a_restore_failing_on_one_server_loads_nothing(servers, tmp_path):
    root, empty = tmp_path / "snaps", tmp_path / "empty"
    empty.mkdir()
    nodes = snapshot_servers(servers, 2, root)
    addresses = [s.address for s in nodes]
    job, trainer, model, opt, data = one_rank(addresses, 1)
    c = client_for(addresses)
    try:
        tools.snapshot(c, job, "t")
        train_steps(model, opt, 0, 1, data, range(1, 3))
        nodes[1].servicer.snapshots = SnapshotDir(str(empty))  # server 1 lost its copy
        with pytest.raises(ShardClientError):
            tools.restore(c, job, "t")
        assert versions_of(addresses, job) == {3}
    finally:
        c.close()
        trainer.close()
