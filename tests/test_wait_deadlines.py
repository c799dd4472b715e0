"""Issue 26, requirement 3: every wait of a rank ends at the deadline the user set, retries
included, and its error names what it waited for (the run, the collective or step, the ranks
that arrived and those missing); ranks that disagree about the world size or a buffer's layout
all fail at once, not only the first.

Real servers on 127.0.0.1 reached through gRPC (``local_calls=False``), real ranks (FSDP on a
torch model, or the client's collectives); each waiting rank's peer never comes.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from paramshard.client import ClusterSpec, ShardClient, ShardClientError, hang_report
from paramshard.client.rpc import Call
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.strategies import FSDPModel, FSDPOptimizer, ShardingConfiguration

TIMEOUT_S = 4.0
MARGIN_S = 3.0
"""How long past its deadline a failed wait may take to be reported: the server ends a wait a
little before the caller's deadline, and a loaded 2-core machine may not run either at once."""


@pytest.fixture
def address() -> Iterator[str]:
    server = ShardServer("127.0.0.1", 0, local_calls=False).start()
    try:
        yield server.address
    finally:
        server.stop(0)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def client(address: str, rank: int, world: int, run: str, **kw: Any) -> ShardClient:
    kw.setdefault("timeout_s", TIMEOUT_S)
    return ShardClient(ClusterSpec([address]), rank=rank, world_size=world, run_id=run, **kw)


def timed(fn: Callable[[], Any]) -> tuple[float, BaseException]:
    """How long ``fn`` took to raise, and what it raised (it must raise)."""
    began = time.monotonic()
    with pytest.raises(ShardClientError) as info:
        fn()
    return time.monotonic() - began, info.value


def test_configuration_timeout_bounds_a_training_wait(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ShardingConfiguration.from_env(timeout_s=...)`` is the rank's deadline (it used to be
    ignored: the client waited its own 120 s): rank 0 of 2, whose peer never starts, fails
    its step at that deadline, with the step, the missing rank and the arrived one named."""
    monkeypatch.setenv("PARAMSHARD_SERVERS", address)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("PARAMSHARD_RUN", unique("lonely"))
    job = unique("fsdp")
    config = ShardingConfiguration.from_env(job=job, timeout_s=TIMEOUT_S)
    try:
        assert config.client.timeout_s == TIMEOUT_S
        torch.manual_seed(0)
        model = FSDPModel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), config)
        opt = FSDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)

        def train_step() -> None:
            model(torch.randn(4, 8)).sum().backward()
            opt.step()

        took, err = timed(train_step)
    finally:
        config.client.close()
    assert took < TIMEOUT_S + MARGIN_S, f"the wait took {took:.1f} s for a {TIMEOUT_S} s deadline"
    assert took > TIMEOUT_S * 0.8, f"it gave up after {took:.1f} s, before its deadline"
    assert err.code.name == "DEADLINE_EXCEEDED", err
    assert f"buffer '{job}/" in err.details and "step 0" in err.details, err
    assert "missing rank(s) 1 (arrived: 0)" in err.details, err


def test_retries_share_the_call_deadline() -> None:
    """A server that cannot be reached is retried only within the call's deadline: with 100
    retries allowed and a 1 s deadline the call fails after about 1 s (each retry used to get
    a fresh deadline), saying why and how often it tried."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = ShardClient(ClusterSpec([f"127.0.0.1:{port}"]), timeout_s=1.0, retries=100)
    try:
        took, err = timed(lambda: c.call(0, "Status", pb.StatusRequest()))
    finally:
        c.close()
    assert took < 1.0 + MARGIN_S, f"{took:.1f} s for a 1 s deadline"
    assert err.code.name == "UNAVAILABLE" and "connection refused" in err.details, err
    assert "attempts in" in err.details, err


def test_barrier_names_the_missing_rank(address: str) -> None:
    run = unique("barrier")
    c = client(address, 0, 2, run)
    try:
        took, err = timed(c.barrier)
    finally:
        c.close()
    assert took < TIMEOUT_S + MARGIN_S, took
    assert err.code.name == "DEADLINE_EXCEEDED", err
    assert f"all_reduce #1 of run '{run}'" in err.details, err
    assert "missing rank(s) 1 (arrived: 0)" in err.details, err


def test_pipeline_receive_names_the_sender(address: str) -> None:
    """A pipeline stage waiting for an activation its predecessor never sends."""
    run = unique("pipe")
    c = client(address, 1, 2, run)
    try:
        took, err = timed(lambda: c.recv(src=0, tag="act"))
    finally:
        c.close()
    assert took < TIMEOUT_S + MARGIN_S, took
    assert f"message #1 from rank 0 to rank 1 tagged 'act' of run '{run}'" in err.details, err
    assert "rank 0 has not sent it" in err.details, err


def test_pull_at_a_version_names_the_missing_rank(address: str) -> None:
    """A pull of the next version waits for the step the other rank never contributes to."""
    job, n, run = unique("pull"), 16, unique("run")
    c = client(address, 0, 2, run)
    try:
        c.register_buffer(job, "w", n, contributors=2)
        c.set_params(job, "w", np.zeros(n, np.float32))
        c.push_grads(job, "w", np.ones(n, np.float32), 0)
        took, err = timed(lambda: c.pull_params(job, "w", n, min_version=1))
    finally:
        c.close()
    assert took < TIMEOUT_S + MARGIN_S, took
    assert f"buffer '{job}/w' (run '{run}') is at version 0" in err.details, err
    assert "version 1" in err.details and "missing rank(s) 1 (arrived: 0)" in err.details, err


def test_a_late_reply_is_completed_from_the_hang_doctor(address: str) -> None:
    """When grpc says only "Deadline Exceeded" (the server's own words came too late), the
    error gets the server's pending rows about the call: who arrived, who is missing."""
    run = unique("late")
    c = client(address, 0, 2, run)
    try:
        key = f"{run}:ar1/0"
        header = pb.SlotHeader(
            key=key, op=pb.SUM, expected=2, readers=2, total_numel=1, chunk_numel=1,
            chunk=pb.Chunk(offset=0, numel=1, dtype=pb.FLOAT32), contributor=0,
        )  # fmt: skip
        c.run([Call(0, "Contribute", (header, np.ones(1, np.float32)))])
        words = hang_report.complete(
            c, 0, "ReadSlot", pb.ReadSlotRequest(key=key, reader=0), "Deadline Exceeded"
        )
        kept = hang_report.complete(c, 0, "ReadSlot", pb.ReadSlotRequest(key=key), "waited 1 s")
    finally:
        c.close()
    assert words.startswith("Deadline Exceeded (no reply within"), words
    assert f"all_reduce #1 of run '{run}'" in words, words
    assert "missing rank(s) 1 (arrived: 0)" in words, words
    assert kept == "waited 1 s"  # the server's own account is left as it is


# ------------------------------------------------------------------------ ranks that disagree
def test_collective_world_size_mismatch_fails_both_ranks_fast(address: str) -> None:
    """Rank 0 thinks the world has 2 ranks, rank 1 thinks 3: the second contribution to the
    all-reduce is refused, and the first rank's wait ends at once with the same reason (the
    slot itself is left as it is: tests/test_bad_slots.py)."""
    run, deadline = unique("ws"), 60.0
    first = client(address, 0, 2, run, timeout_s=deadline)
    second = client(address, 1, 3, run, timeout_s=deadline)
    outcomes: dict[str, tuple[float, BaseException]] = {}
    try:
        t = threading.Thread(
            target=lambda: outcomes.__setitem__("first", timed(first.barrier)), daemon=True
        )
        t.start()
        _settle(lambda: _open_slots(address, run), "rank 0's contribution")
        outcomes["second"] = timed(second.barrier)
        t.join(deadline)
    finally:
        first.close()
        second.close()
    for who, (took, err) in outcomes.items():
        assert took < 15.0, f"{who} rank waited {took:.1f} s (deadline {deadline} s)"
        assert "expected is 2 for earlier contributors, 3 for contributor" in err.details, err
        assert err.code.name == "FAILED_PRECONDITION", err


@pytest.mark.parametrize("first_world", [2, 3])
def test_fsdp_world_size_mismatch_fails_both_ranks_fast(address: str, first_world: int) -> None:
    """Two FSDP ranks of one run, one told WORLD_SIZE=2 and the other 3 (either first): one
    registration is refused, and the rank that registered waits no more (it used to wait its
    whole deadline for a rank that had already failed)."""
    run, job, deadline = unique("ws"), unique("wsjob"), 60.0
    worlds = {2: 0, 3: 1}  # world size -> rank
    outcomes: dict[int, tuple[float, BaseException]] = {}

    def rank(world: int) -> None:
        c = client(address, worlds[world], world, run, timeout_s=deadline)
        try:
            config = ShardingConfiguration(c, job=job)
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))

            def train() -> None:
                model = FSDPModel(net, config)
                opt = FSDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
                model(torch.randn(4, 8)).sum().backward()
                opt.step()

            outcomes[world] = timed(train)
        finally:
            c.close()

    second_world = 5 - first_world
    t = threading.Thread(target=rank, args=(first_world,), daemon=True)
    t.start()
    _settle(lambda: _jobs(address, job), f"the world-{first_world} rank's registration")
    rank(second_world)
    t.join(deadline)
    assert set(outcomes) == {2, 3}
    for world, (took, err) in outcomes.items():
        assert took < 30.0, f"the world-{world} rank waited {took:.1f} s (deadline {deadline} s)"
        assert err.code.name == "FAILED_PRECONDITION", err
        assert "contributors (data-parallel ranks)" in err.details, err
    assert "exists with another layout" in outcomes[second_world][1].details
    assert "the ranks of this run disagree" in outcomes[first_world][1].details


def test_another_runs_refused_registration_leaves_a_job_alone(address: str) -> None:
    """A job name taken by a second run with another layout: that run is refused, and the
    first run's waits go on (only a refusal within the same run ends them)."""
    job, n = unique("taken"), 16
    mine = client(address, 0, 2, unique("mine"), timeout_s=1.5)
    other = client(address, 0, 1, unique("other"))
    try:
        mine.register_buffer(job, "w", n, contributors=2)
        mine.set_params(job, "w", np.zeros(n, np.float32))
        mine.push_grads(job, "w", np.ones(n, np.float32), 0)
        with pytest.raises(ShardClientError, match="exists with another layout"):
            other.register_buffer(job, "w", n, contributors=1)
        took, err = timed(lambda: mine.pull_params(job, "w", n, min_version=1))
    finally:
        mine.close()
        other.close()
    assert err.code.name == "DEADLINE_EXCEEDED" and took > 1.0, (took, err)


def _settle(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _status(address: str) -> pb.StatusReply:
    c = ShardClient(ClusterSpec([address]), timeout_s=5.0)
    try:
        return c.call(0, "Status", pb.StatusRequest(pending=True))
    finally:
        c.close()


def _open_slots(address: str, run: str) -> bool:
    return any(row.run == run for row in _status(address).pending)


def _jobs(address: str, job: str) -> bool:
    return any(j.job == job for j in _status(address).jobs)


def _barrier_unless_rank_1(config: Any) -> None:
    if config.rank == 0:
        config.client.barrier()


def test_local_cluster_timeout_is_each_ranks_deadline() -> None:
    """``LocalCluster(timeout_s=...)`` is a configuration field like any other: a rank whose
    peer skips a barrier fails at that deadline, naming the peer."""
    from paramshard.local_cluster import LocalCluster, RankFailed

    with LocalCluster(2, timeout_s=TIMEOUT_S) as cluster:
        began = time.monotonic()
        with pytest.raises(RankFailed) as info:
            cluster.run(_barrier_unless_rank_1)
        took = time.monotonic() - began
    assert info.value.rank == 0 and took < TIMEOUT_S + MARGIN_S, (took, info.value)
    assert "missing rank(s) 1 (arrived: 0)" in str(info.value), info.value
