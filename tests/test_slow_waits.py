"""A long wait on other ranks says so while it waits (client/slow_waits.py): every
``PARAMSHARD_WAIT_NOTICE_S`` the waiting rank logs the collective, how long it waited of its
deadline, and the ranks its server still waits for, or that the server did not answer.

Real servers on 127.0.0.1 (in-process, through gRPC or called directly; and a `paramshard
serve` process stopped with SIGSTOP), real clients; each waiting rank's peer never comes, or
comes late.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pytest
from conftest import worker_env

from paramshard.client import ClusterSpec, ShardClient, ShardClientError, slow_waits
from paramshard.client.futures import Done, ShmFuture
from paramshard.client.local_calls import LocalFuture
from paramshard.client.membership import Membership, MembershipError
from paramshard.server import ShardServer

NOTICE_S = 1.0
TIMEOUT_S = 4.5
LOGGER = "paramshard.client.hang_report"


@pytest.fixture(params=["grpc", "in-process"])
def address(request: pytest.FixtureRequest) -> Iterator[str]:
    server = ShardServer("127.0.0.1", 0, local_calls=request.param == "in-process").start()
    try:
        yield server.address
    finally:
        server.stop(0)


def client(address: str, rank: int, run: str, timeout_s: float = TIMEOUT_S) -> ShardClient:
    return ShardClient(
        ClusterSpec([address]), rank=rank, world_size=2, run_id=run, timeout_s=timeout_s
    )


def notices(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_long_wait_names_the_missing_rank_while_it_waits(
    address: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's all-reduce waits for rank 1, which never comes: about one notice a second
    names the collective and the missing rank, and the wait still ends at its deadline."""
    monkeypatch.setenv(slow_waits.NOTICE_ENV, str(NOTICE_S))
    run = f"slow-{uuid.uuid4().hex[:8]}"
    c = client(address, 0, run)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    began = time.monotonic()
    try:
        with pytest.raises(ShardClientError) as info:
            c.all_reduce(np.ones(3, np.float32))
    finally:
        c.close()
    took = time.monotonic() - began
    assert info.value.code.name == "DEADLINE_EXCEEDED", info.value
    assert took < TIMEOUT_S + 3.0, f"the wait took {took:.1f} s for a {TIMEOUT_S} s deadline"
    said = notices(caplog)
    # one a second from 1 s until the deadline's 4.5 s; a loaded machine may skip one
    assert 2 <= len(said) <= 4, said
    for words in said:
        assert re.search(r"has waited \d+ s of its 4.5 s deadline", words), words
        assert f"all_reduce #1 of run '{run}'" in words, words
        assert "missing rank(s) 1 (arrived: 0)" in words, words
        assert "rank 1 holds no lease here: not started, or cut off" in words, words
    waited = [int(re.search(r"waited (\d+) s", w).group(1)) for w in said]
    assert waited == sorted(waited) and len(set(waited)) == len(waited), said


def test_a_peer_that_comes_ends_the_notices(
    address: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 comes after 2.5 s: rank 0 said it waited, the all-reduce is right, and nothing
    is said once it ended."""
    monkeypatch.setenv(slow_waits.NOTICE_ENV, str(NOTICE_S))
    run = f"late-{uuid.uuid4().hex[:8]}"
    first, second = client(address, 0, run, 30.0), client(address, 1, run, 30.0)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    results: dict[int, np.ndarray] = {}
    try:
        t = threading.Thread(target=lambda: results.__setitem__(0, first.all_reduce(np.ones(3))))
        t.start()
        time.sleep(2.5)
        results[1] = second.all_reduce(np.full(3, 2.0))
        t.join(30.0)
        assert not t.is_alive()
        ended = len(notices(caplog))
        time.sleep(2 * NOTICE_S)
    finally:
        first.close()
        second.close()
    assert np.array_equal(results[0], np.full(3, 3.0)) and np.array_equal(results[1], results[0])
    said = notices(caplog)
    assert 1 <= len(said) <= 3 and len(said) == ended, said
    assert all("missing rank(s) 1 (arrived: 0)" in w for w in said), said


def test_a_live_rank_that_does_not_come_is_named_alive(
    address: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 holds its lease (its client is open) but never reaches the all-reduce, as a
    rank stopped in a debugger or stuck in its data loader: the notice says it is alive, so
    the user looks at that rank rather than for a dead one; the deadline's error says so too."""
    monkeypatch.setenv(slow_waits.NOTICE_ENV, str(NOTICE_S))
    run = f"alive-{uuid.uuid4().hex[:8]}"
    # rank 1's client leases its rank as it is made, and it never calls
    first, second = client(address, 0, run), client(address, 1, run)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    try:
        with pytest.raises(ShardClientError) as info:
            first.all_reduce(np.ones(3, np.float32))
    finally:
        first.close()
        second.close()
    alive = "rank 1 is alive (its connection here is open) but has not come"
    said = notices(caplog)
    assert said and all(alive in w for w in said), said
    assert alive in info.value.details, info.value


def test_notices_can_be_turned_off(
    address: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(slow_waits.NOTICE_ENV, "0")
    c = client(address, 0, f"quiet-{uuid.uuid4().hex[:8]}", 2.5)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    try:
        with pytest.raises(ShardClientError):
            c.all_reduce(np.ones(3, np.float32))
    finally:
        c.close()
    assert notices(caplog) == []


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "1e9"])
def test_a_bad_notice_setting_is_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(slow_waits.NOTICE_ENV, value)
    with pytest.raises(ValueError, match="PARAMSHARD_WAIT_NOTICE_S must be seconds in 0..86400"):
        ShardClient(ClusterSpec(["127.0.0.1:1"]))


def test_a_stopped_server_is_named(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server itself is stopped (SIGSTOP) while rank 0 waits in it: the notice says the
    server did not answer, and the wait still ends at its deadline."""
    monkeypatch.setenv(slow_waits.NOTICE_ENV, "2.5")
    serve = subprocess.Popen(
        [sys.executable, "-m", "paramshard", "serve", "--port", "0"],
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    c = None
    try:
        lines = [serve.stdout.readline() for _ in range(1)]
        while not (found := re.search(r"listening on (\S+)", lines[-1])) and len(lines) < 50:
            lines.append(serve.stdout.readline())  # (bounded: the server prints it at start)
        assert found, lines
        c = client(found.group(1), 0, f"stopped-{uuid.uuid4().hex[:8]}", 8.0)
        caplog.set_level(logging.WARNING, logger=LOGGER)
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                c.all_reduce(np.ones(3, np.float32))
            except ShardClientError as exc:
                failed.append(exc)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(1.0)  # the contribution is in; the read waits
        os.kill(serve.pid, signal.SIGSTOP)
        t.join(20.0)
        assert not t.is_alive() and failed, "the wait did not end at its deadline"
    finally:
        if c is not None:
            c.close()
        serve.kill()
        serve.wait(10)
        serve.stdout.close()
    said = notices(caplog)
    assert said, "no notice while the server was stopped"
    assert any("did not answer a Status within 2 s" in w for w in said), said


def test_a_cancelled_in_process_call_ends_its_wait() -> None:
    """A notice cancels the calls in flight (client/leases.py): an in-process call's done
    callbacks run then too, as grpc's do, so a wait watching it ends at once, not at the
    call's deadline."""
    inner: Future = Future()  # the server's handler, still waiting for a peer
    fut = LocalFuture(inner)
    said: list[float] = []
    threading.Timer(0.3, fut.cancel).start()
    began = time.monotonic()
    slow_waits.wait(fut, began, began + 30.0, 10.0, said.append)
    assert time.monotonic() - began < 5.0 and said == []
    ran: list[object] = []
    fut.add_done_callback(ran.append)  # after the end: at once
    assert ran == [fut]


def test_a_call_that_ended_already_returns_at_once() -> None:
    """A call run to its end on grpcio's blocking path (``Done``), also inside a shared-memory
    future: the wait returns at once. (The shared-memory future passed the registration on to
    a ``Done`` that had none: an AttributeError for every such call of a same-host rank.)"""
    said: list[float] = []
    began = time.monotonic()
    for fut in (Done(reply=1), ShmFuture(Done(reply=1), None, None)):  # type: ignore[arg-type]
        slow_waits.wait(fut, began, began + 30.0, 10.0, said.append)
    assert time.monotonic() - began < 5.0 and said == []


def test_a_rank_waiting_below_the_minimum_says_so(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An elastic rank alone where the job needs 2 waits ``elastic_wait_s`` for more, and
    says so every notice meanwhile; it waited in silence before (field review, round 12)."""
    monkeypatch.setenv(slow_waits.NOTICE_ENV, str(NOTICE_S))
    server = ShardServer("127.0.0.1", 0).start()
    c = client(server.address, 0, f"few-{uuid.uuid4().hex[:8]}", 10.0)
    caplog.set_level(logging.WARNING, logger="paramshard.client.membership")
    try:
        waits = Membership(c, "few", min_members=2, window_s=0.5, wait_s=3.5)
        with pytest.raises(MembershipError, match="fewer than the minimum of 2"):
            waits.join(0)
    finally:
        c.close()
        server.stop(0)
    said = [r.getMessage() for r in caplog.records if r.name == "paramshard.client.membership"]
    assert 2 <= len(said) <= 4, said
    assert all("1 rank(s) there (ranks 0), fewer than the minimum of 2" in w for w in said), said
    assert all(re.search(r"waited \d+ s of 4 s \(elastic_wait_s\)", w) for w in said), said


def test_a_steps_buffers_waiting_alike_are_named_once(
    address: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 pushed its gradient for a job's three buffers and waits for the step's check;
    rank 1 never pushes. The server waits for it on each buffer alike, and the notice said the
    same row three times ("step 0 of job 'j': missing rank(s) 1 ...; step 0 of job 'j': ...":
    a field check); it says it once."""
    monkeypatch.setenv(slow_waits.NOTICE_ENV, str(NOTICE_S))
    run = f"slow-{uuid.uuid4().hex[:8]}"
    c = client(address, 0, run)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    names = ["b0", "b1", "b2"]
    try:
        for name in names:
            c.register_buffer("j", name, 4, contributors=2)
            c.set_params("j", name, np.zeros(4, np.float32))
            c.push_grads("j", name, np.ones(4, np.float32), 0)
        with pytest.raises(ShardClientError):
            c.grad_check("j", names, 0)
    finally:
        c.close()
    said = notices(caplog)
    assert said, "no notice"
    for words in said:
        assert words.count("step 0 of job 'j': missing rank(s) 1 (arrived: 0)") == 1, words
