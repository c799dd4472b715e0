"""Deletions racing the other snapshot calls of two servers that share one folder (a
reviewer's probes, round 13): every call ends in a status that says what happened, never
INTERNAL, and whatever is listed afterwards restores.

Before: a listing (and so a Restore of "latest") met a tag folder removed since it read the
job's folder and answered INTERNAL (FileNotFoundError), 17-35 times in about 75 calls; a
Snapshot, or a CommitSnapshot, of a tag another server was deleting wrote into the removed
folder, or lost its temporary file, and answered INTERNAL (3-4 in 60 rounds).

Real in-process servers; the calls are raw gRPC so the codes are the servers' own. Then
deletions racing another caller's on one server (round 14): a prune skips a tag deleted after
it listed, and a deletion whose tag went between its two asks says so.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_snapshot_deletion import step, tags, two  # noqa: F401 - two is a fixture

from paramshard.client import (
    ClusterSpec,
    ParamInfo,
    ShardClient,
    ShardClientError,
    snapshot_deletion,
    tools,
)
from paramshard.protos import shard_pb2 as pb

pytestmark = pytest.mark.timeout(120)
N = 64
SHARD = "/paramshard.v1.Shard/"
RACE_S = 4.0
CLEAN = {"OK", "NOT_FOUND", "FAILED_PRECONDITION", "ALREADY_EXISTS"}


def raw(address: str, method: str, request) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as chan:
        stub = chan.unary_unary(SHARD + method)
        try:
            stub(request.SerializeToString(), timeout=10)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def until(stop: threading.Event, body) -> threading.Thread:
    """A thread running ``body(i)`` until ``stop``, at most 2,000 times."""

    def loop() -> None:
        for i in range(2000):
            if stop.is_set():
                return
            body(i)

    return threading.Thread(target=loop)


def test_deletes_racing_snapshots_and_listings_end_cleanly(servers, tmp_path: Path) -> None:
    nodes = servers(2, snapshot_dir=str(tmp_path))
    a, b = (s.address for s in nodes)
    c = ShardClient(ClusterSpec([a, b]), timeout_s=15, retries=0)
    codes: dict[str, Counter] = {"snapshot": Counter(), "delete": Counter(), "list": Counter()}
    try:
        c.register_buffer("j", "w", N, params=[ParamInfo("w", (N,), 0)])
        c.set_params("j", "w", np.zeros(N, np.float32))
        stop = threading.Event()

        def snapshot(i: int) -> None:
            try:
                tools.snapshot(c, "j", f"t{i % 4}")
                codes["snapshot"]["OK"] += 1
            except ShardClientError as exc:
                codes["snapshot"][exc.code.name] += 1

        def delete(i: int) -> None:  # server 1 deletes what server 0 writes and commits
            request = pb.DeleteSnapshotRequest(job="j", tag=f"t{i % 4}")
            codes["delete"][raw(b, "DeleteSnapshot", request).name] += 1

        def listing(i: int) -> None:
            codes["list"][raw(a, "ListSnapshots", pb.ListSnapshotsRequest(job="j")).name] += 1
            request = pb.ListSnapshotsRequest(job="j", torn=True)
            codes["list"][raw(b, "ListSnapshots", request).name] += 1

        threads = [until(stop, f) for f in (snapshot, delete, listing)]
        for t in threads:
            t.start()
        time.sleep(RACE_S)
        stop.set()
        for t in threads:
            t.join(60)
        for what, seen in codes.items():
            assert seen and set(seen) <= CLEAN, (what, dict(seen))
        assert codes["delete"]["OK"] and codes["snapshot"]["OK"], codes
        for row in tools.list_snapshots(c, "j"):  # whatever is listed restores
            for i, server in enumerate((a, b)):
                check = pb.RestoreRequest(
                    job="j", tag=row["tag"], server_index=i, num_servers=2, check_only=True
                )
                assert raw(server, "Restore", check) == grpc.StatusCode.OK, row
    finally:
        c.close()


def test_a_prune_skips_a_tag_another_caller_deleted(two, monkeypatch) -> None:  # noqa: F811
    """A job's own prune and a cron's ``--keep-last`` race: a tag the other deleted after this
    prune listed it is skipped, and the rest are still deleted. Before, the prune stopped at it
    with KeyError ("no snapshot 'auto-1' on any server"): 8 of 78 of a reviewer's cron runs
    failed beside a job pruning every step."""
    c, _, _ = two
    for v in range(4):
        tools.snapshot(c, "j", f"auto-{v}")
        step(c, v)
    delete = snapshot_deletion._delete
    others = iter(["auto-1"])

    def racing(client, job, tag, folders):  # the other caller's deletion comes first
        for other in others:
            tools.delete_snapshot(c, "j", other)
        return delete(client, job, tag, folders)

    monkeypatch.setattr(snapshot_deletion, "_delete", racing)
    gone = tools.prune_snapshots(c, "j", keep_last=1, prefix="auto")
    assert [g["tag"] for g in gone] == ["auto-0", "auto-2"]
    assert tags(c) == ["auto-3"]


def test_a_tag_gone_between_the_two_asks_is_not_reported_deleted(two, monkeypatch) -> None:  # noqa: F811
    """Another caller deletes the tag after this deletion's check and before its own: this
    one removed nothing. Before, it reported "deleted j/t (torn: no manifest): 0 files"."""
    c, _, _ = two
    tools.snapshot(c, "j", "t")
    run, raced = c.run, []

    def racing(calls):
        calls = list(calls)
        deleting = [x for x in calls if x.method == "DeleteSnapshot" and not x.request.check_only]
        if deleting and not raced:
            raced.append(True)
            tools.delete_snapshot(c, "j", "t")  # the other caller, first
        return run(calls)

    monkeypatch.setattr(c, "run", racing)
    with pytest.raises(KeyError, match="'t' was deleted meanwhile by another caller"):
        tools.delete_snapshot(c, "j", "t")
    assert raced and tags(c) == []
