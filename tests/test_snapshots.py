"""Snapshots (docs/design.md §5.1, issue 4): consistent on one version while training runs,
restorable into the same or a different number of servers, and checked on the way back in.

Real in-process servers, a real tiny GPT trained by W=2 ranks (threads, one ShardClient each),
float64 unless a test says otherwise (the servers keep float64 masters and moments for it).
"Same result" means: snapshot at step K, restore, train on to step N, and the parameters equal
those of the run that was never interrupted, and single-process training, within 1e-9
(tests/numerics.py); with Adam that also proves the moments and the step count (bias
correction) made the round trip.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import run_ranks
from numerics import assert_equivalent
from safetensors import safe_open
from snapshot_job import (
    SNAP_AT,
    STEPS,
    STRATEGIES,
    WORLD,
    assert_same,
    batches,
    client_for,
    code_of,
    continue_job,
    initial_weights,
    new_job,
    pull_all,
    single_process,
    snapshot_servers,
    train_job,
    train_steps,
    versions_of,
    wrap,
)

from paramshard.client import ShardClient, ShardClientError, tools
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer


# -- consistent snapshot, restore, resharding ---------------------------------------------------
@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("n_from,n_to", [(3, 2), (2, 3)])
def test_snapshot_while_training_restores_to_the_same_result(
    servers, tmp_path, strategy, n_from, n_to
):
    root = tmp_path / "snaps"
    addresses, job, final, version = train_job(servers, n_from, root, strategy)
    assert version == SNAP_AT
    # the sharded run is the single-process run
    assert_equivalent(final, single_process(), f"{strategy} on {n_from} servers")

    # on disk: one shard per server, all at one version, listed with bytes and sha256
    folder = root / job / "k"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["version"] == SNAP_AT and manifest["num_servers"] == n_from
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"shard-{i}-of-{n_from}.safetensors" for i in range(n_from)] + ["manifest.json"]
    ), "temporary files left behind"
    assert [s["server"] for s in manifest["shards"]] == list(range(n_from))
    for i, shard in enumerate(manifest["shards"]):
        data = (folder / f"shard-{i}-of-{n_from}.safetensors").read_bytes()
        assert Path(shard["file"]).name == f"shard-{i}-of-{n_from}.safetensors"
        assert shard["bytes"] == len(data)
        assert shard["sha256"] == hashlib.sha256(data).hexdigest()
        with safe_open(str(folder / Path(shard["file"]).name), framework="numpy") as f:
            meta = json.loads(f.metadata()["paramshard"])
            keys = set(f.keys())
        assert meta["version"] == SNAP_AT and meta["server_index"] == i
        assert any(k.endswith("::state.exp_avg") for k in keys), keys  # Adam moments saved
    listed = tools.list_snapshots(client_for(addresses), job)
    assert [(s["tag"], s["version"], s["num_servers"]) for s in listed] == [("k", SNAP_AT, n_from)]

    # 1. the same servers, through the strategy: load_checkpoint and train on
    init, data = initial_weights(), batches()

    def again(client: ShardClient) -> dict:
        model, opt = wrap(strategy, client, job, init)
        assert model.step_count == STEPS  # adopted the servers' version
        client.barrier()  # test_snapshot_regressions.py: load_checkpoint waits for every rank
        assert model.load_checkpoint("k") == SNAP_AT
        train_steps(model, opt, client.rank, WORLD, data, range(SNAP_AT, STEPS))
        return model.state_dict()

    assert_same(run_ranks(again, WORLD, addresses)[0], final, "load_checkpoint, same servers")

    # 2. a different number of servers: tools.restore, then fresh wrappers adopt the version
    other = [s.address for s in snapshot_servers(servers, n_to, root)]
    c = client_for(other)
    try:
        assert tools.restore(c, job, "k") == SNAP_AT
    finally:
        c.close()
    assert versions_of(other, job) == {SNAP_AT}
    assert_same(continue_job(other, job, strategy, SNAP_AT), final, f"restored into {n_to}")


@pytest.mark.equivalence
def test_save_checkpoint_on_every_rank_and_latest(servers, tmp_path):
    """model.save_checkpoint (every rank calls it) and load_checkpoint('latest')."""
    root = tmp_path / "snaps"
    addresses = [s.address for s in snapshot_servers(servers, 2, root)]
    init, data, job = initial_weights(), batches(), new_job()

    def rank(client: ShardClient) -> tuple[dict, dict]:
        model, opt = wrap("zero1", client, job, init)
        train_steps(model, opt, client.rank, WORLD, data, range(1))
        assert model.save_checkpoint("one") == 1
        train_steps(model, opt, client.rank, WORLD, data, range(1, SNAP_AT))
        assert model.save_checkpoint("three") == SNAP_AT
        train_steps(model, opt, client.rank, WORLD, data, range(SNAP_AT, STEPS))
        final = model.state_dict()
        assert model.load_checkpoint("latest") == SNAP_AT
        train_steps(model, opt, client.rank, WORLD, data, range(SNAP_AT, STEPS))
        return final, model.state_dict()

    for final, again in run_ranks(rank, WORLD, addresses):
        assert_same(again, final)
    tags = [s["tag"] for s in tools.list_snapshots(client_for(addresses), job)]
    assert tags == ["one", "three"]


# -- what does not count, and what is refused ---------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Any:
    """Two servers sharing a snapshot dir, one job trained STEPS steps by W=2 (FSDP), with
    snapshots 'k' (version SNAP_AT) and 'end' (version STEPS)."""
    root = tmp_path_factory.mktemp("snaps")
    started: list[ShardServer] = []

    def factory(n: int, **kw: Any) -> list[ShardServer]:
        new = [ShardServer("127.0.0.1", 0, **kw).start() for _ in range(n)]
        started.extend(new)
        return new

    addresses, job, final, _ = train_job(factory, 2, root, "fsdp")
    c = client_for(addresses)
    tools.snapshot(c, job, "end")
    c.close()
    yield {"root": root, "addresses": addresses, "job": job, "final": final}
    for s in started:
        s.stop(0)


def copy_snapshot(trained: dict, tag: str, new_tag: str) -> Path:
    """A copy of snapshot ``tag`` under ``new_tag`` (manifest's tag updated: a valid one)."""
    folder = trained["root"] / trained["job"] / tag
    dst = trained["root"] / trained["job"] / new_tag
    shutil.copytree(folder, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    (dst / "manifest.json").write_text(json.dumps({**manifest, "tag": new_tag}))
    return dst


def restore_fails(trained: dict, tag: str) -> ShardClientError:
    """Restore must fail on every server and change nothing."""
    addresses, job = trained["addresses"], trained["job"]
    before = pull_all(addresses, job)
    assert versions_of(addresses, job) == {STEPS}
    c = client_for(addresses)
    try:
        with pytest.raises(ShardClientError) as excinfo:
            tools.restore(c, job, tag)
    finally:
        c.close()
    assert versions_of(addresses, job) == {STEPS}
    after = pull_all(addresses, job)
    for name, values in before.items():
        np.testing.assert_array_equal(after[name], values, err_msg=name)
    return excinfo.value


def test_restore_checks_every_file(trained):
    job = trained["job"]

    # flipped bytes in the middle of a shard
    bad = copy_snapshot(trained, "k", "flipped")
    shard = bad / "shard-1-of-2.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    err = restore_fails(trained, "flipped")
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(shard) in err.details and "checksum" in err.details

    # truncated
    bad = copy_snapshot(trained, "k", "truncated")
    shard = bad / "shard-0-of-2.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    err = restore_fails(trained, "truncated")
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(shard) in err.details and "truncated" in err.details

    # a shard missing
    bad = copy_snapshot(trained, "k", "missing")
    (bad / "shard-1-of-2.safetensors").unlink()
    err = restore_fails(trained, "missing")
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert str(bad / "shard-1-of-2.safetensors") in err.details
    assert "missing" not in [
        s["tag"] for s in tools.list_snapshots(client_for(trained["addresses"]), job)
    ]

    # a shard of another snapshot (another version) swapped in
    bad = copy_snapshot(trained, "k", "swapped")
    shutil.copyfile(
        trained["root"] / job / "end" / "shard-0-of-2.safetensors",
        bad / "shard-0-of-2.safetensors",
    )
    err = restore_fails(trained, "swapped")
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(bad / "shard-0-of-2.safetensors") in err.details

    # ... even with its checksum patched into the manifest: the version inside gives it away
    manifest = json.loads((bad / "manifest.json").read_text())
    data = (bad / "shard-0-of-2.safetensors").read_bytes()
    manifest["shards"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (bad / "manifest.json").write_text(json.dumps(manifest))
    err = restore_fails(trained, "swapped")
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(bad / "shard-0-of-2.safetensors") in err.details
    assert f"version {STEPS}" in err.details

    # the manifest itself corrupt
    bad = copy_snapshot(trained, "k", "badmanifest")
    (bad / "manifest.json").write_text('{"format": "paramshard-snap')
    err = restore_fails(trained, "badmanifest")
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(bad / "manifest.json") in err.details

    # the good one still restores after all that
    c = client_for(trained["addresses"])
    try:
        assert tools.restore(c, job, "end") == STEPS
    finally:
        c.close()


def test_snapshot_without_manifest_does_not_count(trained):
    job = trained["job"]
    bad = copy_snapshot(trained, "k", "nomanifest")
    (bad / "manifest.json").unlink()
    tags = [s["tag"] for s in tools.list_snapshots(client_for(trained["addresses"]), job)]
    assert "nomanifest" not in tags and {"k", "end"} <= set(tags)
    err = restore_fails(trained, "nomanifest")
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert str(bad / "manifest.json") in err.details
    # "latest" picks the newest complete snapshot, not the incomplete one
    c = client_for(trained["addresses"])
    try:
        assert tools.restore(c, job, "latest") == STEPS
    finally:
        c.close()


def test_snapshot_refusals(servers, tmp_path, trained):
    addresses, job = trained["addresses"], trained["job"]
    c = client_for(addresses)
    try:
        # unknown job: the tool says so before any server writes anything; the RPC: NOT_FOUND
        with pytest.raises(KeyError, match="nosuchjob"):
            tools.snapshot(c, "nosuchjob", "t")
        req = pb.SnapshotRequest(job="nosuchjob", tag="t", version=0, num_servers=2)
        with pytest.raises(ShardClientError) as excinfo:
            c.call(0, "Snapshot", req)
        assert code_of(excinfo) == grpc.StatusCode.NOT_FOUND and "nosuchjob" in str(excinfo.value)
        # a job without snapshots
        with pytest.raises(ShardClientError) as excinfo:
            tools.restore(c, "nosuchjob", "latest")
        assert code_of(excinfo) == grpc.StatusCode.NOT_FOUND

        # names that would leave the snapshot directory
        for tag in ("../x", "..", "a/b", "", "x\\y"):
            with pytest.raises(ShardClientError) as excinfo:
                tools.snapshot(c, job, tag)
            assert code_of(excinfo) == grpc.StatusCode.INVALID_ARGUMENT, tag
            with pytest.raises(ShardClientError) as excinfo:
                tools.restore(c, job, tag)
            assert code_of(excinfo) == grpc.StatusCode.INVALID_ARGUMENT, tag
        assert not (trained["root"].parent / "x").exists()
    finally:
        c.close()

    # a server without a snapshot directory
    plain = [s.address for s in servers(1)]

    def one_step(client: ShardClient) -> None:
        model, opt = wrap("zero1", client, "plainjob", initial_weights())
        train_steps(model, opt, 0, 1, batches(), range(1))

    run_ranks(one_step, 1, plain)
    c = client_for(plain)
    try:
        for call in (
            lambda: tools.snapshot(c, "plainjob", "t"),
            lambda: tools.restore(c, "plainjob", "t"),
            lambda: tools.list_snapshots(c),
        ):
            with pytest.raises(ShardClientError) as excinfo:
                call()
            assert code_of(excinfo) == grpc.StatusCode.FAILED_PRECONDITION
            assert "--snapshot-dir" in excinfo.value.details
    finally:
        c.close()
