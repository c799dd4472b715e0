"""Issue 13, finding 8: pending work never ended and no server-wide memory bound existed.

Half-done reduction slots and unread mailboxes stayed in memory forever, ``DropJob`` left them
(though the proto says it drops pending contributions), and only the per-job ``--max-job-gb``
(off by default) bounded memory: a ``train`` token with a large ``num_micro`` could stage
gradient copies without end. Now slots and mailboxes expire (``pending_ttl_s``), DropJob drops
a run's slots with its job, and one server-wide account (``max_memory``) pays for buffers,
staging, slots, mailboxes and replicas before they are allocated. Each test runs over real
gRPC; every refused call leaves the server as it was.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import slot_held
from test_cli import ServeProcess, paramshard

from paramshard.client import ClusterSpec, ShardClient, ShardClientError, StepArgs, tools
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.buffers.slice_state import (
    SLICE_RECORD_BYTES,
    STAGED_RECORD_BYTES,
    buffer_bytes,
)
from paramshard.server.optimizers import OPTIMIZERS
from paramshard.server.runtime import backend
from paramshard.server.runtime.limits import default_memory_limit, host_memory, parse_bytes

N = 1024


def make_client(server: Any, rank: int = 0, world: int = 1, **kw: Any) -> ShardClient:
    kw.setdefault("timeout_s", 5.0)
    return ShardClient(ClusterSpec([server.address]), rank=rank, world_size=world, **kw)


def contribute(c: ShardClient, key: str, contributor: int = 0, numel: int = 4) -> Any:
    header = pb.SlotHeader(
        key=key,
        op=pb.SUM,
        expected=2,
        readers=1,
        total_numel=numel,
        chunk_numel=numel,
        chunk=pb.Chunk(offset=0, numel=numel, dtype=pb.FLOAT32),
        contributor=contributor,
    )
    return c.call(0, "Contribute", (header, np.ones(numel, np.float32)))


def slots_of(c: ShardClient) -> tuple[int, int]:
    (row,) = c.status()
    return int(row["open_slots"]), int(row["slot_bytes"])


def settle(condition: Any, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def fails(call: Any, *args: Any, **kw: Any) -> ShardClientError:
    with pytest.raises(ShardClientError) as err:
        call(*args, **kw)
    return err.value


# --- pending work ends ------------------------------------------------------------------------
def test_slots_and_mailboxes_expire_and_give_their_memory_back(servers) -> None:
    (server,) = servers(1, pending_ttl_s=0.3, local_calls=False)
    sender = make_client(server, rank=0, world=2, run_id="r")
    receiver = make_client(server, rank=1, world=2, run_id="r")
    budget = server.servicer.budget
    try:
        contribute(sender, "r:ar1")  # half a reduction: rank 1 never comes
        sender.send(np.arange(N, dtype=np.float32), dst=1)  # a mailbox nobody reads
        held = slot_held("r:ar1", 16) + slot_held("r:p2p0-1/1", N * 4)  # values and records
        assert slots_of(sender) == (2, held) and budget.usage()["slots"] == held
        settle(lambda: slots_of(sender) == (0, 0), "the slots to expire")
        assert budget.used == 0
        err = fails(contribute, sender, "r:ar1", contributor=1)  # a late contribution
        assert err.code == grpc.StatusCode.ABORTED
        assert "slot 'r:ar1' expired: no contribution or read for 0.3 s" in err.details
        assert "1 of 2 contributions arrived; missing rank(s) 1" in err.details
        err = fails(receiver.recv, 0)
        assert err.code == grpc.StatusCode.ABORTED and "'r:p2p0-1/1' expired" in err.details
        assert slots_of(sender) == (0, 0)
    finally:
        sender.close()
        receiver.close()


def test_a_reader_of_an_expiring_slot_gets_aborted(servers) -> None:
    (server,) = servers(1, pending_ttl_s=0.3, local_calls=False)
    c = make_client(server, rank=0, world=2, run_id="r")
    try:
        err = fails(c.all_reduce, np.ones(4, np.float32))  # rank 1 never comes
        assert err.code == grpc.StatusCode.ABORTED, err  # the expiry, not the 5 s deadline
        assert "slot 'r:ar1/0' expired" in err.details and "missing rank(s) 1" in err.details
    finally:
        c.close()


def test_drop_job_drops_its_pending_contributions_and_its_runs_slots(servers) -> None:
    (server,) = servers(1, local_calls=False)
    server.servicer.buffers.turns.limit = 0  # rank 2's early push is staged at once, not after
    budget = server.servicer.budget  # waiting for a turn that this one thread gives later
    ranks = [make_client(server, rank=r, world=3, run_id="j") for r in range(3)]
    try:
        ranks[0].register_buffer("j", "b", N, contributors=3)
        ranks[0].set_params("j", "b", np.zeros(N, np.float32))
        ranks[2].push_grads("j", "b", np.ones(N, np.float32), 0)  # waits for ranks 0 and 1
        assert budget.usage()["staging"] == N * 4 + STAGED_RECORD_BYTES  # values and record
        ranks[0].send(np.ones(N, np.float32), dst=1)  # a mailbox
        failed: list[ShardClientError] = []

        def reduce() -> None:  # a reader waiting for ranks 1 and 2
            try:
                ranks[0].all_reduce(np.ones(4, np.float32))
            except ShardClientError as exc:
                failed.append(exc)

        reader = threading.Thread(target=reduce)
        reader.start()
        settle(lambda: slots_of(ranks[0])[0] == 2, "the reader's slot")
        assert ranks[0].call(0, "DropJob", pb.DropJobRequest(job="j")).buffers == 1
        reader.join(5.0)
        (err,) = failed
        assert err.code == grpc.StatusCode.ABORTED
        assert "slot 'j:ar1/0' was dropped with run 'j' (DropJob)" in err.details
        (row,) = ranks[0].status()
        assert row["jobs"] == [] and (int(row["open_slots"]), int(row["slot_bytes"])) == (0, 0)
        # the ranks' shared-memory segments are theirs, not the job's: they stay (protos/shm.py)
        shm_bytes = budget.usage().pop("shm")
        assert shm_bytes == server.servicer.segments.usage()[1]
        left = {k: v for k, v in budget.usage().items() if k != "shm"}
        assert left == {"buffers": 0, "staging": 0, "slots": 0, "replicas": 0, "snapshots": 0}
        err = fails(ranks[1].recv, 0)
        assert err.code == grpc.StatusCode.ABORTED and "dropped with run 'j'" in err.details
        # a run's slots alone (no job of that name) are dropped too; neither: NOT_FOUND
        contribute(ranks[0], "j.e1/dp0:ar1")
        assert ranks[0].call(0, "DropJob", pb.DropJobRequest(job="j")).buffers == 0
        err = fails(ranks[0].call, 0, "DropJob", pb.DropJobRequest(job="j"))
        assert err.code == grpc.StatusCode.NOT_FOUND and "'j'" in err.details
    finally:
        for c in ranks:
            c.close()


# --- the server-wide memory bound ---------------------------------------------------------------
def test_the_memory_limit_refuses_what_does_not_fit_and_changes_nothing(servers) -> None:
    (server,) = servers(1, max_memory="64KiB", local_calls=False)
    server.servicer.buffers.turns.limit = 0  # micro-batches 1.. of one thread, and never 0:
    budget = server.servicer.budget  # each would wait for its turn until the bound first
    c = make_client(server)
    try:
        # Adam: params, grads and three state arrays of 4 KiB: 80 KiB, and the slice's record
        err = fails(c.register_buffer, "big", "b", 4 * N, optimizer="adam")
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (
            f"buffer 'big/b': {81_920 + SLICE_RECORD_BYTES:,} more bytes of buffers would exceed"
            " this server's memory limit of 65,536 bytes (0 in use; --max-memory)" in err.details
        )
        assert c.status()[0]["jobs"] == [] and budget.used == 0

        # SGD over 4 contributors: params, grads, momentum (12 KiB); early pushes are staged
        c.register_buffer("j", "b", N, contributors=4)
        c.set_params("j", "b", np.zeros(N, np.float32))
        assert budget.usage()["buffers"] == 3 * 4 * N + SLICE_RECORD_BYTES
        micro, staged = 1, 4 * N + STAGED_RECORD_BYTES  # a staged push's values and record
        while budget.used + staged <= budget.limit:  # a train token's huge num_micro
            c.push_grads("j", "b", np.ones(N, np.float32), 0, micro=micro, num_micro=1000)
            micro += 1
        in_use = budget.used
        err = fails(c.push_grads, "j", "b", np.ones(N, np.float32), 0, micro=micro, num_micro=1000)
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{staged:,} more bytes of staging would exceed this server's memory" in err.details
        assert f"({in_use:,} in use; --max-memory)" in err.details
        assert budget.used == in_use  # the refused push kept nothing

        # slots and mailboxes, and replicas being received, are paid for from the same account
        err = fails(contribute, c, "r:ar1", numel=N)
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "slot 'r:ar1'" in err.details
        err = fails(c.send, np.ones(N, np.float32), 0)
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "of slots" in err.details
        chunk = pb.ReplicaChunk(job="gone", version=3, total=10 * N, data=bytes(8 * N))
        err = fails(c.call, 0, "LoadReplica", chunk)
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "of replicas" in err.details
        assert server.servicer.replicator.inbox.pending() == {}
        assert slots_of(c) == (0, 0) and budget.used == in_use

        # dropping the job gives everything back: what did not fit fits now
        c.drop_job("j")
        assert budget.used == 0
        contribute(c, "r:ar2", numel=N)
        assert budget.usage()["slots"] == slot_held("r:ar2", 4 * N)
    finally:
        c.close()


def test_slots_of_no_element_are_paid_for_and_bounded(servers) -> None:
    """Found in review: the budget paid for a slot's arrays, not its records, so slots of no
    element cost nothing: 150,000 of them took 849 MiB beside a --max-memory of 256 MiB. Now
    a slot is charged its records (measured: server/collectives/slot.py), and the limit
    refuses new ones once they fill it."""
    (server,) = servers(1, max_memory="1MiB", local_calls=False)
    c = make_client(server)
    budget = server.servicer.budget
    opened = 0
    try:
        for i in range(2000):
            try:
                contribute(c, f"r:none{i}", numel=0)
            except ShardClientError as err:
                assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "of slots would exceed this server's memory limit" in err.details
                break
            opened += 1
        assert 0 < opened < 2000
        assert budget.usage()["slots"] == sum(slot_held(f"r:none{i}", 0) for i in range(opened))
        assert slots_of(c) == (opened, budget.usage()["slots"])
    finally:
        c.close()


def test_snapshot_copies_and_restored_slices_are_paid_for(servers, tmp_path) -> None:
    """Found in review: a Snapshot's host copies and a Restore's slices were charged nothing
    (six snapshots at once of a job of 16M elements grew a server by 1.34 GiB under a 1 GiB
    limit, its account unmoved; six Restores with ``check_only`` 1.57 GiB). Now a call pays
    for them while it holds them ("snapshots"): a snapshot that fits is taken, one and a
    restore that do not are refused, and nothing stays charged."""
    n, states = 64 * 1024, len(OPTIMIZERS["adam"].state_names)
    snapshot = 2 * 3 * 4 * n  # params and Adam's two moments copied, and their file
    limit = buffer_bytes(n, 4, states) + SLICE_RECORD_BYTES + snapshot + 64 * 1024
    (server,) = servers(1, max_memory=limit, snapshot_dir=str(tmp_path))
    budget = server.servicer.budget
    c = make_client(server)
    try:
        c.register_buffer("j", "b", n, optimizer="adam")
        c.set_params("j", "b", np.ones(n, np.float32), version=1)
        c.push_grads("j", "b", np.ones(n, np.float32), 1)
        c.step("j", 1, {"b": StepArgs({"lr": 0.0})})  # the moments exist now; params stay
        assert server.servicer.buffers.get("j", "b").capture_bytes() == 3 * 4 * n
        tools.snapshot(c, "j", "a")  # fits beside the job
        assert budget.usage()["snapshots"] == 0
        c.register_buffer("k", "b", n // 2, optimizer="adam")  # what is left: 14n + 56 KiB
        before = budget.used
        err = fails(tools.snapshot, c, "j", "b")  # 24n
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "snapshot of job 'j'" in err.details and "of snapshots would exceed" in err.details
        check = pb.RestoreRequest(job="j", tag="a", num_servers=1, check_only=True)
        err = fails(c.call, 0, "Restore", check)  # a slice (20n) and its arrays as read (12n)
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "restore of job 'j'" in err.details and "of snapshots would exceed" in err.details
        assert budget.used == before and budget.usage()["snapshots"] == 0
        assert [s["tag"] for s in tools.list_snapshots(c, "j")] == ["a"]
        np.testing.assert_array_equal(c.pull_params("j", "b", n), np.ones(n, np.float32))
    finally:
        c.close()


def test_status_metrics_report_memory_in_use_and_the_limit(servers) -> None:
    pytest.importorskip("prometheus_client")
    (server,) = servers(1, max_memory="1MiB", metrics_port=0)
    c = make_client(server)
    try:
        c.register_buffer("j", "b", N)
        text = server.metrics.render().decode()
        assert "paramshard_memory_limit_bytes 1.048576e+06" in text
        buffers = float(12288 + SLICE_RECORD_BYTES)  # params, grads, momentum; the slice's record
        assert f'paramshard_memory_reserved_bytes{{kind="buffers"}} {buffers}' in text
        assert 'paramshard_memory_reserved_bytes{kind="staging"} 0.0' in text
    finally:
        c.close()


def test_memory_sizes_and_the_default_limit() -> None:
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("4096") == parse_bytes("4 KiB") == parse_bytes("4k") == 4096
    assert parse_bytes("50%", total=1000) == 500
    assert parse_bytes("0") == 0
    for bad in ("", "8 parsecs", "-1", "GiB", "120%"):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)
    with open("/proc/meminfo") as f:
        (line,) = [ln for ln in f if ln.startswith("MemTotal:")]
    assert 0 < host_memory() <= int(line.split()[1]) * 1024
    server = ShardServer("127.0.0.1", 0)  # not started: backend and limit are set at construction
    try:
        if backend.device == "cpu":
            expected = int(0.9 * host_memory())
        else:  # a GPU (PARAMSHARD_TEST_BACKEND=cuda:N): a fraction of the device's memory
            expected = int(0.9 * backend.device_memory()["total"])
        assert default_memory_limit() == expected
        assert server.servicer.budget.limit == expected
    finally:
        server.stop(0)


def test_serve_flags_set_the_bounds() -> None:
    served = ServeProcess(
        "--port", "0", "--max-memory", "64KiB", "--pending-ttl", "0.5", "--max-wait-s", "1",
        "--workers", "4", "--max-waiting-read", "2", "--max-streams", "1",
        "--max-pending-calls", "64", "--max-slot-mb", "0.015625",
    )  # fmt: skip
    try:
        address, _ = served.wait_listening()
        c = ShardClient(ClusterSpec([address]), rank=0, world_size=1, timeout_s=10.0)
        try:
            err = fails(c.register_buffer, "big", "b", 4 * N, optimizer="adam")
            assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "memory limit of 65,536 bytes" in err.details
            err = fails(c.all_reduce, np.ones(8192, np.float32))  # 32 KiB in slots
            assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "slot memory limit of 16,384 bytes" in err.details
            c.register_buffer("j", "b", N)
            c.set_params("j", "b", np.zeros(N, np.float32))
            err = fails(c.pull_params, "j", "b", N, 5)
            assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and "waited 1.0 s" in err.details
        finally:
            c.close()
    finally:
        served.stop()
    result = paramshard("serve", "--port", "0", "--max-memory", "12 parsecs")
    assert result.returncode != 0 and "memory size '12 parsecs'" in result.stderr
    result = paramshard("serve", "--port", "0", "--workers", "4", "--reserved-workers", "4")
    assert result.returncode == 2
    assert "--reserved-workers (4) must be below --workers (4)" in result.stderr
    result = paramshard("serve", "--port", "0", "--max-pending-calls", "0")
    assert result.returncode == 2 and "--max-pending-calls" in result.stderr
