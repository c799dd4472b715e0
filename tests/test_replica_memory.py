"""Neighbour replicas are paid for before they are made (docs/security.md, sixteenth round).

A field check on GPT-2 124M took each server to 7.5-8.4 GB with ``replicate_every=1``, against
1.07 GB without: the copies taken on the training path and waiting to be encoded were outside
the memory account, and a server with ``--max-memory 2GiB`` reached 5.3 GB while it refused
every replica. Real servers on 127.0.0.1:0; the budget is the server's own.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid

import grpc
import numpy as np
import pytest
import torch
from two_ranks import sgd_step, two_fsdp_ranks

from paramshard.client import ClusterSpec, ShardClient, ShardClientError, StepArgs, tools
from paramshard.client import replicas as client_replicas
from paramshard.protos import shard_pb2 as pb
from paramshard.server.buffers.slice_state import slice_bytes
from paramshard.server.buffers.store import BufferSlice
from paramshard.strategies import train_with_recovery

pytestmark = pytest.mark.timeout(120)

N = 400_000  # elements of the test buffer: 200,000 a server, 0.8 MB an array


def step(c: ShardClient, s: int) -> None:
    c.push_grads("j", "w", np.ones(N, np.float32), step=s)
    c.step("j", s, {"w": StepArgs({"lr": 0.1})})


def replicas(c: ShardClient, i: int) -> pb.ListReplicasReply:
    return c.call(i, "ListReplicas", pb.ListReplicasRequest(job="j"))


def settled(server, timeout: float = 20.0) -> None:
    """Waits until the server's replicator has nothing captured or queued."""
    rep = server.servicer.replicator
    deadline = time.monotonic() + timeout
    while rep._queue or rep._collecting:
        assert time.monotonic() < deadline, "replicas still queued"
        time.sleep(0.05)


@pytest.fixture
def job(servers):
    nodes = servers(2)
    c = ShardClient(ClusterSpec([s.address for s in nodes]), timeout_s=15.0, retries=0)
    c.register_buffer("j", "w", N, optimizer="adam", hyper={"lr": 0.1})
    c.set_params("j", "w", np.arange(N, dtype=np.float32))
    step(c, 0)  # Adam's moments exist from here
    yield nodes, c
    c.close()


def test_a_copy_past_the_memory_limit_is_not_made(job, monkeypatch) -> None:
    nodes, c = job
    copies = []
    real = BufferSlice.copy_state
    monkeypatch.setattr(BufferSlice, "copy_state", lambda b: copies.append(b) or real(b))
    budgets = [s.servicer.replicator.budget for s in nodes]
    for b in budgets:  # room for the job, not for a copy of its slice (2.4 MB)
        b.limit = b.used + 1_000_000
    tools.configure_replication(c, "j", 1)
    for s in range(1, 4):
        step(c, s)
    for i, node in enumerate(nodes):
        settled(node)
        reply = replicas(c, i)
        assert reply.replicas == [], reply
        assert "memory limit" in reply.failure and "--max-memory" in reply.failure, reply
        assert budgets[i].usage()["replicas"] == 0
    # refused before it was made: nothing was copied for a replica that could not be kept
    assert copies == []
    # training went on, and a server given room replicates again, its failure forgotten
    for b in budgets:
        b.limit = 0
    step(c, 4)
    for i, node in enumerate(nodes):
        settled(node)
        deadline = time.monotonic() + 20
        while not [r for r in replicas(c, i).replicas if r.own and r.version == 5]:
            assert time.monotonic() < deadline, replicas(c, i)
            time.sleep(0.05)
    assert copies


def test_the_account_holds_exactly_the_kept_replicas(job) -> None:
    """Copies and joins are paid for while they live and given back after: once the queue
    is empty, the servers' replica account is the bytes of the replicas they keep."""
    nodes, c = job
    tools.configure_replication(c, "j", 1)
    for s in range(1, 6):
        step(c, s)
    deadline = time.monotonic() + 20
    for i, node in enumerate(nodes):
        settled(node)
        rep = node.servicer.replicator
        while True:  # the neighbour's newest replica arrived
            held = {r.version for r in replicas(c, i).replicas if not r.own}
            if 6 in held or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert held and 6 in held, replicas(c, i)
        with rep._lock:
            kept = sum(map(len, rep.own.get("j", {}).values()))
            kept += sum(len(b) for k, v in rep.held.items() for b in v.values())
        assert rep.inbox.pending() == {}
        assert rep.budget.usage()["replicas"] == kept
        assert replicas(c, i).failure == ""


def test_train_with_recovery_says_when_replicas_fail(servers, monkeypatch, caplog) -> None:
    """Rank 0 asks every ``CHECK_STEPS`` steps; before, a rank trained on with no replica and
    learnt it only when a server died."""
    addresses = [s.address for s in servers(2)]
    monkeypatch.setattr(client_replicas, "CHECK_STEPS", 2)
    monkeypatch.setattr(BufferSlice, "capture_bytes", lambda b: 2**50)  # past any limit

    def body(r: int, model, opt) -> None:
        step = lambda s: sgd_step(model, opt, torch.full((2, 4), float(s + r)))  # noqa: E731
        train_with_recovery(model, step, 4, checkpoint_every=0)

    job = f"warn-{uuid.uuid4().hex[:6]}"
    with caplog.at_level(logging.WARNING, logger="paramshard.replication"):
        out = two_fsdp_ranks(addresses, job, body, replicate_every=1)
    assert not any(isinstance(v, BaseException) for v in out.values()), out
    said = [r.getMessage() for r in caplog.records if "replicas fail" in r.getMessage()]
    assert len(said) == 2, said  # after steps 2 and 4, from rank 0 only
    assert all(f"job '{job}'" in m and "memory limit" in m for m in said), said
    assert "server 0:" in said[0] and "server 1:" in said[0], said


def test_asking_about_replicas_does_not_wait_on_a_stalled_server(job, monkeypatch) -> None:
    """``say_failures`` runs inside a training step: a server that accepts connections but
    never answers (a stalled host, here a socket nobody reads) is left out after
    ``ASK_TIMEOUT_S``. Before, the question waited the client's whole deadline (15 s here,
    120 s by default) with retries; the servers that answer are still reported."""
    nodes, c = job
    for b in (s.servicer.replicator.budget for s in nodes):
        b.limit = b.used + 1_000_000  # no room for a copy: each server reports a failure
    tools.configure_replication(c, "j", 1)
    step(c, 1)
    for node in nodes:
        settled(node)
    monkeypatch.setattr(client_replicas, "ASK_TIMEOUT_S", 1.0)
    with socket.socket() as stalled:
        stalled.bind(("127.0.0.1", 0))
        stalled.listen()
        port = stalled.getsockname()[1]
        spec = ClusterSpec([nodes[0].address, f"127.0.0.1:{port}", nodes[1].address])
        asker = ShardClient(spec, timeout_s=15.0)
        try:
            began = time.monotonic()
            failed = client_replicas.say_failures(asker, "j")
            took = time.monotonic() - began
        finally:
            asker.close()
    assert took < 5.0, took  # the 1 s bound and a connection's setup, far from 15 s
    assert failed and failed[0].startswith("server 0:") and "memory limit" in failed[0], failed
    assert [f.split(":")[0] for f in failed] == ["server 0", "server 2"], failed


def test_loading_a_replica_pays_for_decoding_it(job) -> None:
    """A rollback (and a LoadReplica) joins the replica and lets safetensors copy its
    tensors, two copies of its size while the slices are built: they are paid for first.
    Before, a server with room for the slices alone took them past its limit; now it is
    refused with nothing changed, and a server with room loads the replica."""
    nodes, c = job
    tools.configure_replication(c, "j", 1)
    step(c, 1)
    rep = nodes[0].servicer.replicator
    deadline = time.monotonic() + 20
    while 2 not in {r.version for r in replicas(c, 0).replicas if r.own}:
        assert time.monotonic() < deadline, replicas(c, 0)
        time.sleep(0.05)
    settled(nodes[0])
    blob = rep.own["j"][2]
    step(c, 2)  # the job moves on: version 3, its replica kept as well
    settled(nodes[0])
    before = c.pull_params("j", "w", N, 3)
    slices = nodes[0].servicer.buffers.jobs()["j"]
    need = sum(slice_bytes(b.spec) for b in slices)
    rep.budget.limit = rep.budget.used + need + len(blob)  # the slices and one copy, not two
    with pytest.raises(ShardClientError) as err:
        c.call(0, "RollbackToReplica", pb.RollbackRequest(job="j", version=2))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    assert "RollbackToReplica: replica of job 'j'" in err.value.details, err.value
    assert "--max-memory" in err.value.details, err.value
    np.testing.assert_array_equal(c.pull_params("j", "w", N, 3), before)  # nothing changed
    rep.budget.limit = rep.budget.used + need + 2 * len(blob)
    c.call(0, "RollbackToReplica", pb.RollbackRequest(job="j", version=2))
    assert nodes[0].servicer.buffers.jobs()["j"][0].version == 2
