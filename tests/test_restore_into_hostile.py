"""Hostile and careless uses of ``RestoreRequest.into`` and of the 3D carry built on it
(``HybridShardedModel.load_checkpoint`` of a snapshot taken in another layout).

* The name a snapshot is loaded as is a job name whatever the snapshot holds: a manifest that
  lists no buffers (an admin may commit one) made a job of any name, of any length, outside
  the memory account (the name was checked only as part of each buffer's registration).
* The drop of a failed carry's leftovers drops only leftovers: a live job that is named like
  a carry's copy once was (``<job>.carry.pp<s>.tp<t>``: a part of a 3D job named
  ``<job>.carry``) stays; the copy is named for the run that carries it now.
* A rank that cannot read the loaded copy stops every rank before any writes: the ranks'
  check of the snapshot (an all-reduce of each rank's problems) was matched by the failing
  rank's ``barrier`` (an all-reduce of a zero) and the others wrote their parts, leaving the
  live job half carried (some parts at the snapshot's version and values, some as they were).

docs/security.md, twenty-first round.
"""

from __future__ import annotations

import json
import tempfile
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hybrid_runs import AGAIN, BATCH, FIRST, adamw, batches, initial_weights, new_gpt

import paramshard.client.carry as carry_module
import paramshard.client.jobs as jobs_module
from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.client.jobs import server_jobs
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.manifest import new_manifest
from paramshard.server import ShardServer
from paramshard.strategies import HybridShardedModel, HybridShardedOptimizer, ShardingConfiguration

pytestmark = pytest.mark.timeout(300)


# -- the server: Restore.into's name ----------------------------------------------------------
def test_into_is_a_job_name_even_when_the_snapshot_lists_no_buffers(tmp_path):
    s = ShardServer("127.0.0.1", 0, snapshot_dir=str(tmp_path)).start()
    c = ShardClient(ClusterSpec([s.address]), timeout_s=20, retries=0)
    try:
        c.register_buffer("z", "w", 8)
        c.set_params("z", "w", np.zeros(8, np.float32))
        shard = c.call(
            0, "Snapshot", pb.SnapshotRequest(job="z", tag="t", version=0, num_servers=1)
        )
        entry = {"file": shard.file, "server": 0, "bytes": shard.bytes, "sha256": shard.sha256}
        manifest = new_manifest("z", "t", shard.version, 1, {}, [entry])  # no buffers
        c.call(0, "CommitSnapshot", pb.CommitSnapshotRequest(
            job="z", tag="t", manifest_json=json.dumps(manifest)))  # fmt: skip
        before = sorted(s.servicer.buffers.jobs())
        for name in ("q" * 100_000, "q" * 257):
            with pytest.raises(ShardClientError) as err:
                c.call(0, "Restore", pb.RestoreRequest(job="z", tag="t", num_servers=1, into=name))
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value.details
            assert sorted(s.servicer.buffers.jobs()) == before  # no job of that name
    finally:
        c.close()
        s.stop(0)


# -- the 3D carry -----------------------------------------------------------------------------
TRAINED, LOADED = (1, 2, 1), (2, 1, 1)  # (pp, tp, dp): stages and tensor ranks both change


def _run(layout: tuple[int, int, int], addresses: list[str], job: str, body: Any) -> list:
    """``body(rank, model, train)`` on every rank (threads); a rank's exception is returned.
    Collectives wait 15 s for a rank that is gone."""
    pp, tp, dp = layout
    world, run, data, init = pp * tp * dp, uuid.uuid4().hex[:6], batches(FIRST + AGAIN), None
    init = initial_weights()

    def rank(r: int) -> Any:
        client = ShardClient(
            ClusterSpec(addresses), rank=r, world_size=world, run_id=run, timeout_s=15
        )
        try:
            net = new_gpt()
            net.load_state_dict(init)
            config = ShardingConfiguration(client, job=job)
            model = HybridShardedModel(
                net, config, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                data_parallel_size=dp, micro_batch_count=2,
            )  # fmt: skip
            HybridShardedOptimizer(adamw(model.parameters()), config)
            per, d = BATCH // model.data_parallel_size, model.data_parallel_rank

            def train(s: int) -> float:
                part = data[s, d * per : (d + 1) * per]
                return model.train_on_batch(part[:, :-1], part[:, 1:])

            return body(r, model, train)
        except Exception as exc:  # noqa: BLE001 - what the rank saw
            return exc
        finally:
            client.close()

    with ThreadPoolExecutor(world) as pool:
        return [f.result(timeout=240) for f in [pool.submit(rank, r) for r in range(world)]]


@pytest.fixture(scope="module")
def snapshot_root() -> Any:
    """A snapshot "t1" of a job trained FIRST steps in layout TRAINED: (root, job, version)."""
    root = Path(tempfile.mkdtemp(prefix="carry-hostile-"))
    job = f"gpt3d-{uuid.uuid4().hex[:6]}"
    nodes = [ShardServer("127.0.0.1", 0, snapshot_dir=str(root)).start() for _ in range(2)]
    try:

        def body(r: int, model: Any, train: Any) -> int:
            for s in range(FIRST):
                train(s)
            return model.save_checkpoint("t1")

        versions = _run(TRAINED, [n.address for n in nodes], job, body)
        assert len(set(versions)) == 1 and isinstance(versions[0], int), versions
    finally:
        for n in nodes:
            n.stop(0)
    return root, job, versions[0]


def _held(addresses: list[str]) -> Any:
    c = ShardClient(ClusterSpec(addresses), timeout_s=10)
    try:
        return server_jobs(c)
    finally:
        c.close()


@pytest.fixture
def servers(snapshot_root) -> Any:
    root, _, _ = snapshot_root
    nodes = [ShardServer("127.0.0.1", 0, snapshot_dir=str(root)).start() for _ in range(2)]
    yield [n.address for n in nodes]
    for n in nodes:
        n.stop(0)


def _load(r: int, model: Any, train: Any) -> Any:
    return model.load_checkpoint("t1")


@pytest.mark.usefixtures("one_torch_thread")
def test_the_drop_of_leftovers_keeps_a_live_job_named_like_a_carry(snapshot_root, servers):
    _, job, version = snapshot_root
    victim = f"{job}.carry.pp0.tp0"  # tensor rank 0 of stage 0 of a 3D job named '<job>.carry'
    c = ShardClient(ClusterSpec(servers), timeout_s=10)
    try:
        c.register_buffer(victim, "w", 64, optimizer="adam", hyper={"lr": 0.1})
        c.set_params(victim, "w", np.arange(64, dtype=np.float32))
        got = _run(LOADED, servers, job, _load)
        assert victim in server_jobs(c).jobs, "a live job was dropped as a carry's leftover"
        assert np.array_equal(c.pull_params(victim, "w", 64, 0), np.arange(64, dtype=np.float32))
    finally:
        c.close()
    # it loads (the copy under a name of its own), or refuses the name: never drops the job
    assert all(g == version for g in got) or all(isinstance(g, Exception) for g in got), got


def _part_versions(addresses: list[str], job: str) -> dict[str, set[int]]:
    held = _held(addresses)
    parts = [j for j in held.jobs if j.startswith(f"{job}.pp")]
    return {j: {b.version for b in held.status[j].buffers} for j in parts}


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("where", ["listing", "values"])
def test_a_rank_that_cannot_read_the_copy_stops_every_rank_before_a_write(
    snapshot_root, servers, monkeypatch, where
):
    """Rank 1 fails reading the loaded copy: its listing of the servers' jobs (``where`` =
    "listing") or its pulls of the copy's values ("values"). Every rank raises, and no part
    of the live job is written: all are still at version 0, the job as the model made it."""
    _, job, _ = snapshot_root
    faulty: set[int] = set()

    def failing(real: Any, why: str) -> Any:
        def call(client: Any, *args: Any, **kwargs: Any) -> Any:
            named = [a for a in args if isinstance(a, str)]
            if threading.get_ident() in faulty and (why == "listing" or ".carry" in named[0]):
                raise ConnectionError(f"rank 1 lost its servers ({why})")
            return real(client, *args, **kwargs)

        return call

    if where == "listing":
        monkeypatch.setattr(carry_module, "server_jobs", failing(carry_module.server_jobs, where))
    else:
        monkeypatch.setattr(jobs_module, "pull_param", failing(jobs_module.pull_param, where))

    def body(r: int, model: Any, train: Any) -> Any:
        if r == 1:
            faulty.add(threading.get_ident())
        return model.load_checkpoint("t1")

    got = _run(LOADED, servers, job, body)
    assert all(isinstance(g, Exception) for g in got), got
    versions = _part_versions(servers, job)
    assert versions and all(v == {0} for v in versions.values()), (
        f"the live job was half carried: {versions}"
    )
