"""Calls that found their object before another call took it out of the server: a slice a
DropJob retired, the slices a Snapshot captured while a buffer was registered, a slot a reader
gave up on. Found by a review that raced calls on one job; each interleaving is forced here
(a call's first step, then the other call, then the rest), so each test fails without its fix
every time, where the race itself struck once in thousands of tries.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from lease_fakes import contribute

from paramshard.client import ClusterSpec, ShardClient, StepArgs, tools
from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.slots import SlotStore
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.limits import MemoryBudget

pytestmark = pytest.mark.timeout(120)
N = 16


def test_a_set_params_that_found_a_slice_a_drop_then_retired_changes_nothing(servers) -> None:
    """Before: a SetParams of a new version released the staged contribution's charge that
    the DropJob had released already; the account went below zero (an AssertionError here, on
    a server with other jobs: every later release failed, and DropJob ended INTERNAL)."""
    (server,) = servers(1)
    server.servicer.buffers.turns.limit = 0  # an early push is staged at once
    ranks = [ShardClient(ClusterSpec([server.address]), rank=r, world_size=3) for r in range(3)]
    try:
        ranks[0].register_buffer("j", "w", N, optimizer="sgd", hyper={"lr": 0.1})
        ranks[0].set_params("j", "w", np.zeros(N, np.float32))
        ranks[2].push_grads("j", "w", np.ones(N, np.float32), step=0)  # staged: 0 and 1 first
        budget = server.servicer.budget
        assert budget.usage()["staging"] > 0
        found = server.servicer.buffers.get("j", "w")  # SetParams' first step
        ranks[0].call(0, "DropJob", pb.DropJobRequest(job="j"))
        header = pb.SetParamsHeader(
            ref=pb.BufferRef(job="j", buffer="w"),
            chunk=pb.Chunk(offset=0, numel=N, dtype=pb.FLOAT32),
            version=7,
        )
        with pytest.raises(ShardError) as err:  # the rest of it
            found.set_params(header, memoryview(np.zeros(N, np.float32)).cast("B"))
        assert err.value.code == grpc.StatusCode.NOT_FOUND and "was dropped" in err.value.message
        assert budget.usage() == dict.fromkeys(budget.usage(), 0)
    finally:
        for c in ranks:
            c.close()


def test_a_snapshot_lists_the_buffers_its_shard_holds(servers, tmp_path) -> None:
    """A buffer registered while the Snapshot waited for its version: before, the reply (and
    the manifest built from it) listed it, its shard did not hold it, and the snapshot, the
    newest, could not be restored."""
    (server,) = servers(1, snapshot_dir=str(tmp_path))
    c = ShardClient(ClusterSpec([server.address]), timeout_s=30)
    try:
        c.register_buffer("j", "a", N, optimizer="sgd", hyper={"lr": 0.1})
        c.set_params("j", "a", np.zeros(N, np.float32))
        request = pb.SnapshotRequest(job="j", tag="t", version=1, num_servers=1)
        replies: list[pb.SnapshotReply] = []
        waiting = threading.Thread(target=lambda: replies.append(c.call(0, "Snapshot", request)))
        waiting.start()
        a = server.servicer.buffers.get("j", "a")
        for _ in range(200):  # the Snapshot asked for version 1 and waits for it
            if 1 in a.capture_requests:
                break
            waiting.join(0.05)
        assert 1 in a.capture_requests
        c.register_buffer("j", "b", N, optimizer="sgd", hyper={"lr": 0.1})
        c.push_grads("j", "a", np.ones(N, np.float32), step=0)
        c.step("j", 0, {"a": StepArgs({"lr": 0.1})})
        waiting.join(30)
        (reply,) = replies
        assert [b.buffer for b in reply.buffers] == ["a"]  # before: ['a', 'b']
    finally:
        c.close()


def test_a_snapshot_whose_servers_hold_different_buffers_is_not_committed(
    servers, tmp_path
) -> None:
    """The client's own check: a manifest lists the buffers of the first server's reply, and
    a buffer another server's shard holds besides (registered or dropped as the shards were
    written) would be lost to a restore that says OK."""
    nodes = servers(2, snapshot_dir=str(tmp_path))
    c = ShardClient(ClusterSpec([s.address for s in nodes]), timeout_s=30)
    try:
        c.register_buffer("j", "a", N, optimizer="sgd", hyper={"lr": 0.1})
        c.set_params("j", "a", np.zeros(N, np.float32))
        spec = pb.RegisterBufferRequest(  # on server 1 only
            ref=pb.BufferRef(job="j", buffer="b"),
            numel=N,
            num_servers=2,
            server_index=1,
            contributors=1,
            optimizer=pb.OptimizerSpec(name="sgd", hyper={"lr": 0.1}),
        )
        c.call(1, "RegisterBuffer", spec)
        with pytest.raises(RuntimeError, match="shards hold different buffers"):
            tools.snapshot(c, "j", "t")
        assert tools.list_snapshots(c, "j") == []
    finally:
        c.close()


def header(key: str, contributor: int) -> pb.SlotHeader:
    return pb.SlotHeader(key=key, op=pb.SUM, expected=2, readers=1, contributor=contributor)


def test_a_contribution_to_a_slot_a_reader_gave_up_on_lands_in_the_stores_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Contribute looked the slot up; a read timed out on it, unused, and forgot it; then the
    contribution went on. Before, it was added to the forgotten slot: lost to the readers, its
    charge held for good, out of reach of DropJob and the sweeper."""
    budget = MemoryBudget()
    slots = SlotStore(budget=budget)
    found = slots._slot("r:k")  # Contribute's first step
    with pytest.raises(ShardError) as err:
        slots.read(pb.ReadSlotRequest(key="r:k", offset=0, reader=0), timeout=0.05)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    lookups = iter([found])
    real = slots._slot
    monkeypatch.setattr(slots, "_slot", lambda key: next(lookups, None) or real(key))
    contribute(slots, "r:k", 0, readers=1)  # the rest of it
    contribute(slots, "r:k", 1, readers=1)
    _, payload = slots.read(pb.ReadSlotRequest(key="r:k", offset=0, reader=0), timeout=1.0)
    assert np.frombuffer(payload, np.float32).tolist() == [2.0] * 4
    assert budget.usage()["slots"] == 0  # read by its reader: freed


def test_a_reader_that_gives_up_leaves_the_slot_to_one_still_waiting() -> None:
    """Two readers wait on an empty slot; one gives up. Before, it forgot the slot under the
    other: the contributions opened a new one and the reader still waiting timed out."""
    slots = SlotStore()
    got: list[bytes] = []
    patient = threading.Thread(
        target=lambda: got.append(
            slots.read(pb.ReadSlotRequest(key="r:k", offset=0, reader=1), timeout=10.0)[1]
        )
    )
    patient.start()
    with pytest.raises(ShardError):
        slots.read(pb.ReadSlotRequest(key="r:k", offset=0, reader=0), timeout=0.3)
    contribute(slots, "r:k", 0, readers=2)
    contribute(slots, "r:k", 1, readers=2)
    patient.join(10.0)
    assert len(got) == 1 and np.frombuffer(got[0], np.float32).tolist() == [2.0] * 4
