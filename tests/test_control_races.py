"""Control-plane calls that race on one server, each interleaving forced (round ten,
docs/security.md). Found by a hostile review; each test failed before its fix:

- ConfigureReplication racing DropJob: the job's replica was kept, and charged, after the
  drop, out of reach of any later DropJob (NOT_FOUND).
- StoreReplica racing DropJob on the receiving server: the same, on the neighbour.
- Two snapshots under one tag: the second replaced the first's uncommitted shard, and the
  first then committed a manifest naming the old checksum; it said OK and could not restore.
- RegisterBuffer calls at once passed ``--max-job-gb`` together: each checked the quota
  before any of them was in.
- A Restore, or a buffer registered late, stopped a replicating job's replicas for good,
  while its configuration still said it replicated.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient, StepArgs, tools
from paramshard.client.replicas import configure_replication
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb
from paramshard.server.replication import held as held_module

pytestmark = pytest.mark.timeout(120)
N = 1000
WAIT_S = 20.0  # a replica sent by the background thread, on a busy machine


def job_on(c: ShardClient, job: str, buffer: str = "w", version: int = 0) -> None:
    c.register_buffer(job, buffer, N, optimizer="sgd", hyper={"lr": 0.1})
    c.set_params(job, buffer, np.zeros(N, np.float32), version=version)


def step(c: ShardClient, job: str, s: int, buffers: tuple[str, ...] = ("w",)) -> None:
    for b in buffers:
        c.push_grads(job, b, np.ones(N, np.float32), step=s)
    c.step(job, s, {b: StepArgs({"lr": 0.1}) for b in buffers})


def replicas_kept(server: Any) -> tuple[int, list, list]:
    """(bytes charged to replicas, jobs configured, jobs with replicas kept) on ``server``."""
    rep = server.servicer.replicator
    held = sorted({job for job, _ in rep.held} | set(rep.own))
    return server.servicer.budget.usage()["replicas"], sorted(rep.configs), held


def until(check: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"not within {WAIT_S:g} s: {what}"
        time.sleep(0.05)


@pytest.fixture
def pair(servers, tmp_path: Path) -> Any:
    """(client, server a, server b): two servers sharing a snapshot folder."""
    a, b = servers(2, snapshot_dir=str(tmp_path))
    c = ShardClient(ClusterSpec([a.address, b.address]), timeout_s=15, retries=0)
    yield c, a, b
    c.close()


def test_configure_replication_racing_drop_job_keeps_nothing(pair, monkeypatch) -> None:
    c, a, _ = pair
    job_on(c, "j")
    rep = a.servicer.replicator
    probe = rep._probe

    def dropped_while_probing(cfg: pb.ReplicationConfig) -> None:
        probe(cfg)
        a.servicer.drop_job(pb.DropJobRequest(job="j"), None)

    monkeypatch.setattr(rep, "_probe", dropped_while_probing)
    to_b = pb.ReplicationConfig(job="j", every=1, neighbour=pair[2].address, num_servers=2)
    with pytest.raises(ShardClientError) as info:
        c.call(0, "ConfigureReplication", to_b)
    assert info.value.code == grpc.StatusCode.NOT_FOUND, info.value
    assert "dropped or restored while its neighbour was asked" in info.value.details
    time.sleep(0.3)  # the sender would have kept a replica by now (it did before)
    assert replicas_kept(a) == (0, [], []), "before: the replica stayed, charged"


def test_store_replica_racing_drop_job_keeps_nothing(pair, monkeypatch) -> None:
    c, a, b = pair
    job_on(c, "j")
    checked = threading.Event()
    check_header = held_module.check_header

    def dropped_while_arriving(blob: bytes, chunk: pb.ReplicaChunk, what: str) -> None:
        b.servicer.drop_job(pb.DropJobRequest(job="j"), None)  # B's slices retire now
        check_header(blob, chunk, what)
        checked.set()

    monkeypatch.setattr(held_module, "check_header", dropped_while_arriving)
    to_b = pb.ReplicationConfig(job="j", every=1, neighbour=b.address, num_servers=2)
    c.call(0, "ConfigureReplication", to_b)  # A alone; it sends a first copy to B at once
    until(checked.is_set, "A's replica reached B")
    time.sleep(0.1)
    assert replicas_kept(b)[0::2] == (0, []), "before: B kept the dropped job's replica"


def test_a_shard_replaced_by_a_later_snapshot_is_not_committed(servers, tmp_path: Path) -> None:
    (server,) = servers(1, snapshot_dir=str(tmp_path))
    c = ShardClient(ClusterSpec([server.address]), timeout_s=15, retries=0)
    try:
        job_on(c, "j", version=1)
        manifest = tools.snapshot(c, "j", "real")  # a manifest of version 1, as a template
        first = c.call(0, "Snapshot", pb.SnapshotRequest(job="j", tag="t", version=1,
                                                         num_servers=1))  # fmt: skip
        step(c, "j", 1)  # version 2
        # a second caller takes tag "t" at version 2 (the first's shard looks abandoned) ...
        c.call(0, "Snapshot", pb.SnapshotRequest(job="j", tag="t", version=2, num_servers=1))
        # ... and the first commits its manifest of version 1 only now
        manifest["tag"] = "t"
        manifest["shards"][0].update(file=first.file, bytes=first.bytes, sha256=first.sha256)
        request = pb.CommitSnapshotRequest(job="j", tag="t", manifest_json=json.dumps(manifest))
        with pytest.raises(ShardClientError) as info:
            c.call(0, "CommitSnapshot", request)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION, info.value
        assert "holds version 2, the manifest's is 1" in info.value.details
        assert [s["tag"] for s in tools.list_snapshots(c, "j")] == ["real"]
    finally:
        c.close()


def test_registrations_at_once_stay_within_the_job_quota(servers, monkeypatch) -> None:
    (server,) = servers(1)
    store = server.servicer.buffers
    c = ShardClient(ClusterSpec([server.address]), timeout_s=15, retries=0)
    try:
        c.register_buffer("probe", "w", N, optimizer="adam", hyper={"lr": 0.1})
        one = store.jobs()["probe"][0].reserved
        store.max_job_bytes = one + one // 2  # one buffer of job "q" fits, two do not
        both_created = threading.Barrier(2, timeout=10)
        create = store._create

        def created_together(*args: Any) -> Any:
            made = create(*args)
            both_created.wait()  # both passed the first quota check before either is in
            return made

        monkeypatch.setattr(store, "_create", created_together)
        results: dict[str, str] = {}

        def register(name: str) -> None:
            try:
                c.register_buffer("q", name, N, optimizer="adam", hyper={"lr": 0.1})
                results[name] = "OK"
            except ShardClientError as exc:
                results[name] = exc.code.name

        threads = [threading.Thread(target=register, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(results.values()) == ["OK", "RESOURCE_EXHAUSTED"], results
        assert len(store.jobs()["q"]) == 1
    finally:
        c.close()


def test_a_restored_job_and_a_late_buffer_go_on_replicating(pair) -> None:
    c, a, _ = pair

    def own(job: str, want: list[int]) -> None:
        ask = pb.ListReplicasRequest(job=job)
        seen: list[int] = []

        def there() -> bool:
            seen[:] = sorted(r.version for r in c.call(0, "ListReplicas", ask).replicas if r.own)
            return seen == want

        until(there, f"server 0's own replicas of {job} at {want} (they are at {seen})")

    job_on(c, "r")
    configure_replication(c, "r", 1)
    step(c, "r", 0)
    step(c, "r", 1)
    own("r", [1, 2])
    tools.snapshot(c, "r", "s2")
    step(c, "r", 2)
    assert tools.restore(c, "r", "s2") == 2
    own("r", [2])  # copied at once; version 3 was of the history the Restore left
    step(c, "r", 2)
    step(c, "r", 3)
    own("r", [3, 4])  # before: [1, 2] for good

    job_on(c, "late")
    configure_replication(c, "late", 1)
    step(c, "late", 0)
    own("late", [0, 1])
    job_on(c, "late", "x", version=1)
    step(c, "late", 1, ("w", "x"))
    step(c, "late", 2, ("w", "x"))
    own("late", [2, 3])  # before: [0, 1], the late buffer never copied


def test_a_snapshot_restore_keeps_no_replica_of_the_history_it_left(pair, monkeypatch) -> None:
    """Found in review: history A reached version 2 (snapshot "a2"); the job went back to
    version 1 and trained another version 2 (history B, replicated). Restoring "a2" kept B's
    replicas of version 2, and a server lost before its fresh copy arrived was rebuilt from
    B while the others held A: a silent mix. The fresh copies are held back here; before the
    fix B's version 2 was listed on both servers."""
    c, a, b = pair
    job_on(c, "h")
    configure_replication(c, "h", 1)
    step(c, "h", 0)
    tools.snapshot(c, "h", "s1")
    step(c, "h", 1)
    tools.snapshot(c, "h", "a2")  # history A at version 2
    assert tools.restore(c, "h", "s1") == 1
    c.push_grads("h", "w", np.full(N, 3.0, np.float32), step=1)
    c.step("h", 1, {"w": StepArgs({"lr": 0.1})})  # history B at version 2, replicated
    ask = pb.ListReplicasRequest(job="h")
    until(
        lambda: all(
            2 in {r.version for r in c.call(i, "ListReplicas", ask).replicas} for i in (0, 1)
        ),
        "history B's version 2 replicated on both servers",
    )
    for server in (a, b):  # no fresh copy reaches anyone: only what was kept is listed
        monkeypatch.setattr(server.servicer.replicator, "on_version", lambda b, force=False: None)
    assert tools.restore(c, "h", "a2") == 2
    for i in (0, 1):
        assert list(c.call(i, "ListReplicas", ask).replicas) == [], f"server {i}"
