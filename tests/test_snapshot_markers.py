"""A Snapshot's shard markers (server/snapshots/reservations.py) as a field review found them
(round 11), each case failing before its fix:

1. A restarted server in a container is PID 1 again on the same host name: a marker its dead
   predecessor left named this very process, was taken for a live call, and the tag was
   refused for good (3 of 3 tries). A marker names the process's own random id now.
2. Markers that did not parse (``pid=²``, a pid past the kernel's range) made Snapshot fail
   INTERNAL on every try, and a folder named like a partial shard file made the take-over
   fail INTERNAL once.
3. A marker was read whole: a sparse 1 GiB one took the server from 59 MiB to 2,107 MiB,
   outside ``--max-memory``. At most 512 bytes are read now.
4. Two calls taking over one abandoned marker could both hold the shard (the second removed
   the first's fresh marker and its half-written file) once the window was widened; taking
   over runs under one lock now, and a call lets go of its own marker only.
5. (Found rereading the change.) A Snapshot refused after it took its marker (its shard
   written already) removed the marker by hand and left its entry among the process's live
   holds: one entry more per refusal, for as long as the server ran. It lets go through
   ``Reservation.release`` now.

Real in-process servers writing into the test's folder; the race at the module's level.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import tracemalloc
from pathlib import Path

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient, tools
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb
from paramshard.server.runtime.errors import ShardError
from paramshard.server.snapshots import reservations
from paramshard.server.snapshots.folders import open_root

pytestmark = pytest.mark.timeout(120)
N = 10
SHARD = "shard-0-of-1.safetensors"  # its marker: .SHARD.reserved


@pytest.fixture
def job(servers, tmp_path: Path):
    """A client of job 'j' at version 1 on one server writing snapshots under ``tmp_path``."""
    (server,) = servers(1, snapshot_dir=str(tmp_path))
    c = ShardClient(ClusterSpec([server.address]), timeout_s=15, retries=0)
    c.register_buffer("j", "w", N, optimizer="sgd", hyper={"lr": 0.1})
    c.set_params("j", "w", np.arange(N, dtype=np.float32), version=1)
    yield c
    c.close()


def marked(root: Path, tag: str, text: str | None = None, age_s: float = 0.0) -> Path:
    """Tag folder ``tag`` of job 'j' with shard 0's marker saying ``text``, ``age_s`` old."""
    folder = root / "j" / tag
    folder.mkdir(parents=True)
    marker = folder / f".{SHARD}.reserved"
    if text is not None:
        marker.write_text(text)
        os.utime(marker, (time.time() - age_s,) * 2)
    return marker


def refused(c: ShardClient, tag: str) -> ShardClientError:
    with pytest.raises(ShardClientError) as info:
        tools.snapshot(c, "j", tag)
    return info.value


def test_a_marker_of_an_earlier_process_with_this_pid_is_taken_over(job, tmp_path) -> None:
    host = socket.gethostname()
    for tag, age_s in (("young", 0.0), ("old", 48 * 3600.0)):
        marker = marked(tmp_path, tag, f"paramshard reservation host={host} pid={os.getpid()}\n")
        os.utime(marker, (time.time() - age_s,) * 2)
        assert tools.snapshot(job, "j", tag)["version"] == 1  # before: ALREADY_EXISTS
        assert not marker.exists()


def test_markers_that_do_not_parse_are_held_until_stale_never_internal(job, tmp_path) -> None:
    host = socket.gethostname()
    for i, pid in enumerate(("²", "99999999999", "0", "-1", "")):
        text = f"paramshard reservation host={host} pid={pid}\n"
        marked(tmp_path, f"young{i}", text)
        err = refused(job, f"young{i}")  # before: INTERNAL (ValueError, OverflowError)
        assert err.code == grpc.StatusCode.ALREADY_EXISTS, err
        marker = marked(tmp_path, f"old{i}", text, age_s=2 * reservations.STALE_S)
        assert tools.snapshot(job, "j", f"old{i}")["version"] == 1
        assert not marker.exists()
    marker = marked(tmp_path, "folders", "paramshard reservation host=elsewhere pid=1\n", 1e5)
    (marker.parent / f".{SHARD}.0123456789ab").mkdir()  # named like a partial shard file
    assert tools.snapshot(job, "j", "folders")["version"] == 1  # before: INTERNAL, once
    marker = marked(tmp_path, "folder-marker")
    marker.mkdir()
    err = refused(job, "folder-marker")
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and "remove it" in err.details, err


def test_a_huge_marker_is_read_bounded(job, tmp_path) -> None:
    marker = marked(tmp_path, "huge")
    with open(marker, "wb") as f:  # sparse: no disk, 256 MiB of NULs when read
        f.truncate(256 * 2**20)
    os.utime(marker, (time.time() - 2 * reservations.STALE_S,) * 2)
    tracemalloc.start()
    try:
        assert tools.snapshot(job, "j", "huge")["version"] == 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak:,} bytes at the peak"  # before: the whole file, twice


def test_two_calls_taking_over_one_marker_never_both_hold_it(tmp_path, monkeypatch) -> None:
    gone = subprocess.Popen(["true"])  # a process of this host that no longer runs
    gone.wait()
    text = f"paramshard reservation host={socket.gethostname()} pid={gone.pid}\n"
    marker = marked(tmp_path, "t", text)
    judged, verdicts = reservations._abandoned, []

    def slowly(folder, name):  # the review's widened window, between a verdict and its act:
        verdicts.append(judged(folder, name))  # the first call acts after 0.1 s, the second
        time.sleep(0.1 if len(verdicts) == 1 else 0.5)  # after it, on a verdict now stale
        return verdicts[-1]

    monkeypatch.setattr(reservations, "_abandoned", slowly)
    got: list[object] = []

    def takes() -> None:
        folder = open_root(tmp_path).child("j").child("t")
        try:
            got.append(reservations.take(folder, SHARD, "snapshot 'j/t'"))
        except ShardError as exc:
            folder.close()
            got.append(exc)

    threads = [threading.Thread(target=takes) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    held = [g for g in got if isinstance(g, reservations.Reservation)]
    assert len(held) == 1, got  # before: both
    (other,) = [g for g in got if isinstance(g, ShardError)]
    assert other.code == grpc.StatusCode.ALREADY_EXISTS, other
    assert f"call={held[0].call}" in marker.read_text()
    held[0].release()
    assert not marker.exists()


def test_a_refused_snapshot_lets_go_of_its_hold(job, tmp_path) -> None:
    def snapshot() -> None:
        request = pb.SnapshotRequest(job="j", tag="t", version=1, server_index=0, num_servers=1)
        job.call(0, "Snapshot", request)  # the shard, no manifest: a client's first half

    snapshot()
    live = len(reservations._LIVE)
    for _ in range(5):  # the shard is written at that version: each is refused
        with pytest.raises(ShardClientError) as info:
            snapshot()
        assert info.value.code == grpc.StatusCode.ALREADY_EXISTS, info.value
    assert len(reservations._LIVE) == live  # before: 5 more
    assert not (tmp_path / "j" / "t" / f".{SHARD}.reserved").exists()
