"""``train_with_recovery(keep_last=K)`` keeps the K checkpoints taken last and deletes the
older ones of its ``tag_prefix`` from the servers' folders, as torchtitan's ``keep_latest_k``
does; tags saved by hand stay. Before, every checkpoint stayed, and a job snapshotting every
few hundred steps filled its disk.

Real in-process servers sharing the test's folder; ranks are threads, of an FSDP model (fixed
world and elastic) and of a 3D model (every part's folder of a deleted tag goes).
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
import torch
from hybrid_runs import run_hybrid
from two_ranks import sgd_step, two_fsdp_ranks

from paramshard.client import ClusterSpec, ShardClient, tools
from paramshard.strategies import (
    train_with_recovery,
)

pytestmark = pytest.mark.timeout(180)
STEPS = 10


def train_fsdp(addresses: list[str], job: str, elastic: bool, **kw) -> None:
    """Two ranks train ``job`` for STEPS steps, checkpoints every 2; rank 0 saves "mine"
    first."""

    def body(r: int, model, opt) -> None:
        model.save_checkpoint("mine")
        step = lambda s: sgd_step(model, opt, torch.full((2, 4), float(s + r)))  # noqa: E731
        train_with_recovery(model, step, STEPS, checkpoint_every=2, **kw)

    out = two_fsdp_ranks(addresses, job, body, elastic)
    assert not any(isinstance(v, BaseException) for v in out.values()), out


def listed(addresses: list[str], job: str) -> list[str]:
    client = ShardClient(ClusterSpec(addresses), timeout_s=10)
    try:
        return [r["tag"] for r in tools.list_snapshots(client, job, combine_parts=True)]
    finally:
        client.close()


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed-world", "elastic"])
def test_the_last_checkpoints_are_kept_and_tags_saved_by_hand(servers, tmp_path, elastic) -> None:
    addresses = [s.address for s in servers(2, snapshot_dir=str(tmp_path))]
    train_fsdp(addresses, "kept", elastic, keep_last=2)
    # an elastic job checkpoints before a step only: none at the end
    last = ["auto-6", "auto-8"] if elastic else ["auto-8", "auto-10"]
    assert listed(addresses, "kept") == ["mine", *last]
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == sorted(["mine", *last])


def test_an_empty_prefix_deletes_only_its_own_tags(servers, tmp_path) -> None:
    """``tag_prefix=""`` names checkpoints ``-<step>``: the tags saved by hand were deleted
    with them (an empty prefix was taken for "every tag")."""
    addresses = [s.address for s in servers(2, snapshot_dir=str(tmp_path))]
    train_fsdp(addresses, "empty", False, keep_last=1, tag_prefix="")
    assert listed(addresses, "empty") == ["mine", "-10"]


def test_keep_last_0_keeps_every_checkpoint(servers, tmp_path) -> None:
    addresses = [s.address for s in servers(2, snapshot_dir=str(tmp_path))]
    train_fsdp(addresses, "all", False, keep_last=0)
    assert listed(addresses, "all") == ["mine"] + [f"auto-{s}" for s in range(0, STEPS + 1, 2)]
    with pytest.raises(ValueError, match="keep_last must be 0"):
        train_with_recovery(object(), lambda s: 0.0, 1, keep_last=-1)  # type: ignore[arg-type]


def test_a_3d_jobs_parts_are_deleted_with_their_tag(tmp_path: Path) -> None:
    from paramshard.server import ShardServer

    nodes = [ShardServer("127.0.0.1", 0, snapshot_dir=str(tmp_path)).start() for _ in range(2)]
    addresses, job = [n.address for n in nodes], f"g3d-{uuid.uuid4().hex[:6]}"
    try:

        def body(model, opt, train):
            train_with_recovery(model, train, 5, checkpoint_every=2, keep_last=1)

        run_hybrid(2, 1, 1, addresses, job, body)
        assert listed(addresses, job) == ["auto-4"]
        for part in (f"{job}.pp0.tp0", f"{job}.pp1.tp0"):
            assert [p.name for p in (tmp_path / part).iterdir()] == ["auto-4"], part
    finally:
        for n in nodes:
            n.stop(0)


def test_a_3d_job_ends_only_with_every_parts_servers_whole(tmp_path: Path) -> None:
    """A server of one part lost it after the last update (dropped here, as a restart would
    leave it): each rank asked only about its own part's servers, so the rank of the other
    part returned while this part's rank recovered alone, and failed. Every rank asks about
    every part now, and both recover and end with the part back."""
    from paramshard.client.tensor_parts import part_job
    from paramshard.protos import shard_pb2 as pb
    from paramshard.server import ShardServer

    nodes = [ShardServer("127.0.0.1", 0, snapshot_dir=str(tmp_path)).start() for _ in range(2)]
    addresses, job = [n.address for n in nodes], f"g3d-{uuid.uuid4().hex[:6]}"
    dropped = threading.Event()
    try:

        def body(model, opt, train):
            def finish() -> None:  # once: the part of stage 1 gone from its server, 1
                if model.config.client.rank == 0 and not dropped.is_set():
                    dropped.set()
                    model.config.client.call(
                        1, "DropJob", pb.DropJobRequest(job=part_job(job, 1, 0))
                    )

            report = train_with_recovery(model, train, 4, checkpoint_every=2, finish=finish)
            return report.recoveries, model.step_count

        results = run_hybrid(2, 1, 1, addresses, job, body)
        assert dropped.is_set() and [r[1] for r in results] == [4, 4], results
        assert all(r[0] for r in results), results  # both recovered
        client = ShardClient(ClusterSpec(addresses), timeout_s=10)
        try:
            rows = client.call(1, "Status", pb.StatusRequest()).jobs
            assert {r.job: min(b.version for b in r.buffers) for r in rows}[
                part_job(job, 1, 0)
            ] == 4
        finally:
            client.close()
    finally:
        for n in nodes:
            n.stop(0)
