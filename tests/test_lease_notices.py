"""The client's side of abort notices (client/leases.py, client/run_state.py): a notice cancels
the calls in flight that wait on other ranks and refuses new ones until the next epoch, a lost
server ends the epoch only under ``train_with_recovery``, and, end to end, a peer SIGKILLed
ends the others' waits with the notice, unless it may be restarted (then they wait for it).
The server's lease table: tests/test_leases.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest
from conftest import unique_id, worker_env

from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.client.lease_holds import holder_id
from paramshard.client.leases import LEASE_TTL_ENV
from paramshard.client.run_state import Notice, RunState
from paramshard.protos import shard_pb2 as pb


def test_a_notice_cancels_calls_in_flight_and_refuses_new_ones_until_the_next_epoch(servers):
    (srv,) = servers(1)
    client = ShardClient(ClusterSpec([srv.address]), rank=0, world_size=2, run_id=unique_id())
    try:
        # a read that waits for rank 1's contribution, in flight when the notice comes
        failures: list[ShardClientError] = []

        def wait() -> None:
            try:
                client.all_reduce(np.ones(3, dtype=np.float32))
            except ShardClientError as exc:
                failures.append(exc)

        t = threading.Thread(target=wait)
        t.start()
        client.run_state.abort(Notice("run aborted: rank 1 lost", 0, 1))
        t.join(30)
        assert not t.is_alive() and failures and failures[0].code == grpc.StatusCode.ABORTED
        # worded as the lease's news, not as the server's answer (it had not answered)
        lease = "the run's notice, through this rank's lease (not this server's answer)"
        assert f"{lease}: run aborted: rank 1 lost" in failures[0].details
        with pytest.raises(ShardClientError) as refused:  # refused before it is sent
            client.barrier()
        assert refused.value.code == grpc.StatusCode.ABORTED
        assert refused.value.details.startswith(f"not sent: {lease}: run aborted")
        client.restart_collectives(1)
        assert client.run_state.current() is None
    finally:
        client.close()


@pytest.mark.parametrize("fail_fast", [False, True])
def test_a_lost_server_ends_the_epoch_only_under_recovery(servers, monkeypatch, fail_fast):
    """Server 1 stops answering renewals. Outside ``train_with_recovery`` the calls' own
    retries decide how long to wait for it (a link cut ends nothing); under it
    (``fail_fast``), the rank gives up its epoch after a TTL so every rank recovers at once."""
    monkeypatch.setenv(LEASE_TTL_ENV, "0.5")
    up, down = servers(2)
    spec = ClusterSpec([up.address, down.address])
    client = ShardClient(spec, rank=0, world_size=2, run_id=unique_id())
    try:
        client.run_state.fail_fast = fail_fast
        down.stop(0)
        deadline = time.monotonic() + (30 if fail_fast else 2.5)  # 5 TTLs without
        while client.run_state.current() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        notice = client.run_state.current()
        if fail_fast:
            assert notice is not None and "server 1" in notice.reason, notice
            assert notice.recoverable and "unreachable" in notice.reason
        else:
            assert notice is None, notice
    finally:
        client.close()


def test_notices_apply_to_their_epoch_only():
    state = RunState()
    state.advance(2)
    state.abort(Notice("old", 1))
    assert state.current() is None
    state.abort(Notice("now", 2, 0))
    assert state.current() == Notice("now", 2, 0) and not state.current().recoverable


RANK_1 = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    from paramshard.client import ClusterSpec, ShardClient
    c = ShardClient(ClusterSpec([sys.argv[1]]), rank=1, world_size=2, run_id=sys.argv[2])
    if sys.argv[3] == "first life":
        c.all_reduce(np.ones(3, dtype=np.float32))
        os.kill(os.getpid(), signal.SIGKILL)  # dies with its lease held
    c.send(np.full(3, 7, dtype=np.float32), dst=0)  # restarted: what rank 0 waits for
    c.close()
    """
)


def rank_1(address: str, run: str, life: str, **env: str) -> subprocess.Popen:
    env = {**worker_env(), LEASE_TTL_ENV: "0.5", **env}
    return subprocess.Popen([sys.executable, "-c", RANK_1, address, run, life], env=env)


def test_a_killed_rank_ends_its_peers_wait_with_the_notice(servers, monkeypatch):
    """Rank 1 is SIGKILLed after one all-reduce; rank 0's second all-reduce, whose deadline
    is 60 s away, ends with ABORTED naming rank 1 (without leases it would wait 60 s and end
    with DEADLINE_EXCEEDED)."""
    monkeypatch.setenv(LEASE_TTL_ENV, "0.5")
    (srv,) = servers(1)
    run = unique_id()
    proc = rank_1(srv.address, run, "first life")
    client = ShardClient(ClusterSpec([srv.address]), rank=0, world_size=2, run_id=run, timeout_s=60)
    try:
        np.testing.assert_array_equal(client.all_reduce(np.ones(3, dtype=np.float32)), 2)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        with pytest.raises(ShardClientError) as lost:
            client.all_reduce(np.ones(3, dtype=np.float32))
        assert lost.value.code == grpc.StatusCode.ABORTED, lost.value
        assert "rank 1 lost" in lost.value.details
        notice = client.run_state.refresh()  # the server's own ABORTED may come first
        assert notice is not None and notice.lost_rank == 1 and not notice.recoverable
    finally:
        client.close()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


def test_the_others_wait_for_a_rank_that_may_be_restarted(servers, monkeypatch):
    """Rank 1 may be restarted (PARAMSHARD_MAX_RESTARTS, as ``paramshard launch
    --max-restarts`` sets it): SIGKILLed, its lease lapses, yet the servers wait for its
    restart instead of aborting, and rank 0's receive gets what the restarted rank sends."""
    monkeypatch.setenv(LEASE_TTL_ENV, "0.5")
    (srv,) = servers(1)
    run = unique_id()
    restartable = {"PARAMSHARD_MAX_RESTARTS": "1", "PARAMSHARD_REJOIN_TIMEOUT_S": "60"}
    first = rank_1(srv.address, run, "first life", **restartable)
    client = ShardClient(ClusterSpec([srv.address]), rank=0, world_size=2, run_id=run, timeout_s=60)
    second = None
    try:
        client.all_reduce(np.ones(3, dtype=np.float32))
        assert first.wait(timeout=60) == -signal.SIGKILL
        mine = client.run_state.holding  # asked as rank 0's own client: its stream holds it
        ask = pb.LeaseRequest(
            run=run, rank=0, world_size=2, ttl_ms=500, holder=holder_id(), client=mine.number
        )
        for _ in range(300):  # bounded: until the server saw the lease lapse
            reply = client.call(0, "Lease", ask)
            if list(reply.awaiting) == [1]:
                break
            time.sleep(0.05)
        assert list(reply.awaiting) == [1] and not reply.aborted, reply
        second = rank_1(srv.address, run, "restarted", **restartable)
        np.testing.assert_array_equal(client.recv(1), np.full(3, 7, dtype=np.float32))
        assert second.wait(timeout=60) == 0
        assert client.run_state.refresh() is None
    finally:
        client.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
