"""A snapshot's next attempt (client/checkpoints.py) after one server refused an attempt
because training stepped past its version. The client used to cancel the other servers' calls
at that refusal, but a server goes on with a cancelled Snapshot and holds its shard until it
has written it, so the next attempt found the shard taken ("being written by another
Snapshot call", seen in CI under load). Now every call of an attempt runs to its end before
the next, and a call whose caller went away ends its wait at once. Real servers on 127.0.0.1;
the faults (a refusal, a slow disk) are made inside them."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import grpc
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


def test_a_snapshot_whose_caller_went_away_frees_its_shard(servers, tmp_path):
    """A Snapshot waiting for a version that does not come, whose caller then goes away (the
    call cancelled, as by a trainer that dies): the server ends the wait within a poll
    (``ENDED_POLL_S``, server/runtime/run_names.py) instead of at the call's deadline, and
    the shard it had taken is free for the next Snapshot of the same tag at once (it used to
    be refused ALREADY_EXISTS, "being written by another Snapshot call", until that
    deadline)."""
    nodes = snapshot_servers(servers, 1, tmp_path / "snaps")
    job, trainer, *_ = one_rank([nodes[0].address], 2)  # version 2; nothing steps further
    slot = nodes[0].servicer.buffers.jobs()[job][0]
    req = pb.SnapshotRequest(job=job, tag="t", server_index=0, num_servers=1)
    try:
        with grpc.insecure_channel(nodes[0].address) as chan:
            stub = chan.unary_unary(
                "/paramshard.v1.Shard/Snapshot",
                request_serializer=pb.SnapshotRequest.SerializeToString,
                response_deserializer=pb.SnapshotReply.FromString,
            )
            req.version = 5
            waiting = stub.future(req, timeout=60)
            deadline = time.monotonic() + 10
            while 5 not in slot.capture_requests:  # the server waits for version 5
                assert time.monotonic() < deadline and not waiting.done()
                time.sleep(0.02)
            assert waiting.cancel()
            deadline = time.monotonic() + 10
            while slot.capture_requests:  # its wait ends: the caller went away
                assert time.monotonic() < deadline, "the cancelled Snapshot still waits"
                time.sleep(0.02)
            req.version = 2
            began = time.monotonic()
            reply = stub(req, timeout=20)
            assert reply.version == 2 and reply.bytes > 0
            assert time.monotonic() - began < 10
    finally:
        trainer.close()
