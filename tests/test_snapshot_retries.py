"""A snapshot's next attempt (client/checkpoints.py) after one server refused an attempt
because training stepped past its version. The client used to cancel the other servers' calls
at that refusal, but a server goes on with a cancelled Snapshot and holds its shard until it
has written it, so the next attempt found the shard taken ("being written by another
Snapshot call", seen in CI under load). Now every call of an attempt runs to its end before
the next. Real servers on 127.0.0.1, two of them; the faults (a refusal, a slow disk) are
made inside them."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from snapshot_job import client_for, one_rank, snapshot_servers, train_steps

from paramshard.client import tools
from paramshard.protos import shard_pb2 as pb
from paramshard.server.runtime.errors import ShardError


def test_the_next_attempt_comes_after_a_shard_still_being_written(servers, tmp_path):
    root = tmp_path / "snaps"
    nodes = snapshot_servers(servers, 2, root)
    addresses = [s.address for s in nodes]
    job, trainer, model, opt, data = one_rank(addresses, 2)  # version 2

    calls0 = nodes[0].servicer.snapshot_calls
    real_snapshot, refused = calls0.snapshot, []

    def past_once(req: pb.SnapshotRequest, timeout: float) -> Any:
        if not refused:  # training stepped past the version between Status and Snapshot
            refused.append(req.version)
            raise ShardError.precondition(
                f"slice is at version 3, past the snapshot's {req.version}"
            )
        return real_snapshot(req, timeout)

    calls0.snapshot = past_once
    dir1 = nodes[1].servicer.snapshots
    real_write, writes = dir1.write_shard, []

    def slow_disk(*args: Any) -> Any:
        writes.append(args[4])  # the version
        time.sleep(1.0)  # long after server 0 refused the attempt
        return real_write(*args)

    dir1.write_shard = slow_disk
    snapper = client_for(addresses)
    real_run, sent = snapper.run, []

    def run(calls: Any) -> Any:
        calls = list(calls)
        if calls[0].method == "Snapshot":
            sent.append((calls[0].request.version, time.monotonic()))
            if calls[0].request.version == 3 and sum(v == 3 for v, _ in sent) == 1:
                train_steps(model, opt, 0, 1, data, range(2, 3))  # the servers get there
        return real_run(calls)

    snapper.run = run
    try:
        began = time.monotonic()
        manifest = tools.snapshot(snapper, job, "t")
        assert refused == [2] and writes == [2, 3]
        assert manifest["version"] == 3
        assert sorted(v for v, _ in sent) == [2, 2, 3, 3]  # one attempt at each version
        second = min(t for v, t in sent if v == 3)
        assert second - began >= 1.0  # after server 1's slow write of the first attempt
        for shard in manifest["shards"]:
            on_disk = (root / shard["file"]).read_bytes()
            assert hashlib.sha256(on_disk).hexdigest() == shard["sha256"]
            assert len(on_disk) == shard["bytes"]
        assert tools.restore(snapper, job, "t") == 3
    finally:
        snapper.close()
        trainer.close()
