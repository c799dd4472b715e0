"""Failure detection that tells death from slowness (server/collectives/lease_holds.py,
client/lease_holds.py): a rank's open lease stream holds its lease however long the rank is
stopped or busy, and its end (the process died) loses the rank within seconds.

The lease table's rules for streams are checked with a fake clock; then real rank processes:
one stopped for 10 s (SIGSTOP, SIGCONT) with the old 2 s TTL, one holding the GIL for 5 s on a
machine full of CPU hogs, both ending equal to an uninterrupted run; one SIGKILLed, whose peer
learns "rank 1 lost" within seconds although the TTL is 30 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import unique_id, worker_env
from lease_fakes import KILL_NOTICE_S, Stream, keep, lease, new_table

from paramshard.client.leases import LEASE_TTL_ENV
from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.lease_holds import MAX_WAITING, Hold
from paramshard.server.collectives.leases import STREAM_GRACE_S
from paramshard.server.runtime.errors import ShardError

RANK_SCRIPT = str(Path(__file__).with_name("liveness_rank.py"))
STEPS, PAUSE_S = 10, 0.3


@pytest.fixture
def table():
    return new_table()


def test_an_open_stream_holds_a_lease_that_is_not_renewed(table):
    """Rank 1 stops renewing (stopped, in a GC pause, holding the GIL) for ten minutes while
    its stream stays open: rank 0, renewing all along, never hears that it was lost."""
    leases, clock = table
    leases.open_hold(lease(1), Stream(rank=1))
    reply = keep(leases, clock, 600, 0)
    assert not reply.aborted and not reply.awaiting
    leases.sweep()
    assert not keep(leases, clock, 1, 0).aborted


def test_a_stream_that_ends_loses_its_rank_after_the_grace(table):
    leases, clock = table
    mine, theirs = Stream(rank=1), Stream(rank=0)
    leases.open_hold(lease(1), mine)
    leases.open_hold(lease(0), theirs)
    keep(leases, clock, 5, 0)
    assert leases.end_hold(mine)  # the process died: its kernel closed the connection
    assert not keep(leases, clock, STREAM_GRACE_S - 0.5, 0).aborted  # within the grace
    reply = keep(leases, clock, 1, 0)
    assert reply.lost_rank == 1 and "rank 1 lost (its lease stream" in reply.aborted, reply
    # the other rank's open stream was told at once
    assert [r.lost_rank for r in theirs.pushed] == [1] and theirs.pushed[0].aborted


def test_a_rank_that_holds_again_within_the_grace_is_kept(table):
    """A live client whose connection broke reconnects at once: nothing is aborted."""
    leases, clock = table
    first = Stream(rank=1)
    leases.open_hold(lease(1), first)
    keep(leases, clock, 2, 0)
    assert leases.end_hold(first)
    clock.now += 0.5
    leases.open_hold(lease(1), Stream(rank=1))
    assert not keep(leases, clock, 60, 0).aborted


def test_the_end_of_a_released_ranks_stream_aborts_nothing(table):
    leases, clock = table
    stream = Stream(rank=1)
    leases.open_hold(lease(1), stream)
    leases.renew(lease(1, release=True))  # the client releases first, then ends its streams
    assert not leases.end_hold(stream)
    assert not keep(leases, clock, 10, 0).aborted


def test_streams_cut_from_every_rank_decide_nothing(table):
    """The server's own link is cut: every stream ends (the kernel's timeout), one after the
    other, and no renewal comes. Nobody is taken for lost; the ranks come back."""
    leases, clock = table
    a, b = Stream(rank=0), Stream(rank=1)
    leases.open_hold(lease(0), a)
    leases.open_hold(lease(1), b)
    clock.now += 30
    leases.end_hold(a)
    clock.now += 4  # the other stream's heartbeat was sent later: it ends later
    leases.end_hold(b)
    clock.now += 5
    leases.check("r")
    leases.sweep()
    leases.open_hold(lease(0), Stream(rank=0))
    leases.open_hold(lease(1), Stream(rank=1))
    assert not keep(leases, clock, 5, 0).aborted


def test_a_stopping_server_ends_its_streams_and_decides_nothing(table):
    leases, clock = table
    streams = [Stream(rank=0), Stream(rank=1)]
    for r, s in enumerate(streams):
        leases.open_hold(lease(r), s)
    leases.close()
    assert all(s.stopped for s in streams)
    assert not any(leases.end_hold(s) for s in streams)
    with pytest.raises(ShardError) as refused:
        leases.open_hold(lease(0), Stream())
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_stream_whose_rank_does_not_read_keeps_its_newest_notices_only() -> None:
    """A rank that holds its stream open and never reads it: the notices wait for it, at most
    MAX_WAITING of them, the newest; the server's own stop still gets through. Found by a
    review: one unread stream and a loop of aborts grew a server by 27 kB an abort."""
    hold = Hold("r", 0)
    for step in range(5 * MAX_WAITING):
        hold.push(pb.LeaseReply(lost_rank=step))
    hold.stop()
    got = [hold.next(0.0) for _ in range(MAX_WAITING + 2)]
    assert [g.lost_rank for g in got[:MAX_WAITING]] == list(range(4 * MAX_WAITING, 5 * MAX_WAITING))
    assert got[MAX_WAITING] is not None and got[MAX_WAITING + 1] is None  # the stop, then nothing
    assert hold.dropped == 4 * MAX_WAITING


@pytest.mark.parametrize("extra", [{"release": True}, {"abort": "x"}, {"ttl_ms": 5}])
def test_bad_hold_requests_are_refused(table, extra):
    leases, _ = table
    with pytest.raises(ShardError) as refused:
        leases.open_hold(lease(0, **extra), Stream())
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert not leases._runs


def holding_rank(address: str, run: str) -> subprocess.Popen:
    """A process holding rank 1 of 2 of run ``run`` on the server at ``address``: it has
    all-reduced with rank 0 (which the caller plays), printed "holding", and waits."""
    code = (
        "import time\n"
        "import numpy as np\n"
        "from paramshard.client import ClusterSpec, ShardClient\n"
        f"c = ShardClient(ClusterSpec(['{address}']), rank=1, world_size=2, run_id='{run}')\n"
        "c.all_reduce(np.ones(3, dtype=np.float32))\n"  # both ranks met (its stream: below)
        "print('holding', flush=True)\n"
        "time.sleep(300)\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], env=worker_env(), stdout=subprocess.PIPE, text=True
    )


def test_a_server_streams_the_notice_and_a_killed_client_is_lost(servers):
    """Through gRPC: a client process holding a stream is SIGKILLed; the server takes it for
    lost (its stream closed) and the other client's stream brings the notice."""
    from paramshard.client import ClusterSpec, ShardClient

    (srv,) = servers(1)
    run = unique_id()
    proc = holding_rank(srv.address, run)
    client = ShardClient(ClusterSpec([srv.address]), rank=0, world_size=2, run_id=run)
    table = srv.servicer.leases

    def leases() -> str:  # what the server knows of the run, for a failure's message
        found = table._runs.get(run)
        return "no lease of the run" if found is None else repr(found.leases)

    def streams_of_rank_1() -> int:
        found = table._runs.get(run)
        lease = found.leases.get(1) if found is not None else None
        return lease.holds if lease is not None else 0

    try:
        client.all_reduce(np.ones(3, dtype=np.float32))
        assert proc.stdout.readline().strip() == "holding"
        # Its stream is opened at once but held by the server only when the server has run
        # its handler (a loaded machine may take a while): the case under test needs it held
        # (without a stream the lease lapses a TTL, 30 s, after the last renewal).
        opened = time.monotonic()
        while not streams_of_rank_1() and time.monotonic() - opened < 20:
            time.sleep(0.05)
        assert streams_of_rank_1() == 1, leases()
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        while client.run_state.current() is None and time.monotonic() - killed < 30:
            time.sleep(0.05)
        learned = time.monotonic() - killed
        notice = client.run_state.current()
        assert notice is not None and notice.lost_rank == 1, (notice, leases())
        assert "stream to this server closed" in notice.reason
        print(f"the peer learned in {learned:.2f} s")
        assert learned < KILL_NOTICE_S
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


# ------------------------------------------------------------------------ real rank processes
def start_ranks(addresses: list[str], run: str, args: list[list[str]], **env: str) -> list:
    base = {**worker_env(), "PARAMSHARD_SERVERS": ",".join(addresses), "PARAMSHARD_RUN": run}
    base.update(WORLD_SIZE=str(len(args)), PYTHONUNBUFFERED="1", **env)
    return [
        subprocess.Popen(
            [sys.executable, RANK_SCRIPT, *a],
            env={**base, "RANK": str(r)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r, a in enumerate(args)
    ]


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 120.0) -> list[str]:
    """Lines of ``proc`` up to the one equal to ``text``."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the rank ended before {text!r}: {seen[-5:]}")
        seen.append(line.strip())
        if seen[-1] == text:
            return seen
    raise AssertionError(f"no {text!r} within {timeout} s")


def finish(procs: list, timeout: float = 180.0) -> list[str]:
    """Every rank's output; each must exit 0."""
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        outs.append(out)
        assert proc.returncode == 0, out[-2000:]
    return outs


def params_of(out: str) -> list:
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("PARAMS "))[7:])


def stop_all(procs: list) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list:
    """The job's final parameters, uninterrupted, on its own servers."""
    from paramshard.server import ShardServer

    servers = [ShardServer().start() for _ in range(2)]
    procs = start_ranks([s.address for s in servers], unique_id(), [[str(STEPS), "0"]] * 2)
    try:
        outs = finish(procs)
    finally:
        stop_all(procs)
        for s in servers:
            s.stop(0)
    assert params_of(outs[0]) == params_of(outs[1])
    return params_of(outs[0])


@pytest.mark.slow
def test_a_rank_stopped_for_ten_seconds_is_not_lost(servers, reference):
    """SIGSTOP rank 1 for 10 s at step 3, then SIGCONT, with the 2 s TTL that used to kill
    such ranks: the job finishes, equal to the uninterrupted run."""
    addresses = [s.address for s in servers(2)]
    procs = start_ranks(
        addresses, unique_id(), [[str(STEPS), str(PAUSE_S)]] * 2, **{LEASE_TTL_ENV: "2"}
    )
    try:
        wait_for_line(procs[1], "step 3")
        os.kill(procs[1].pid, signal.SIGSTOP)
        time.sleep(10)
        assert procs[0].poll() is None  # rank 0 waits for it, not aborted
        os.kill(procs[1].pid, signal.SIGCONT)
        outs = finish(procs)
    finally:
        stop_all(procs)
    assert params_of(outs[0]) == params_of(outs[1]) == reference


@pytest.mark.slow
def test_a_busy_machine_and_a_rank_holding_the_gil_lose_nobody(servers, reference):
    """Twice as many CPU hogs as cores for the whole run (each ends on its own after 120 s),
    and rank 1 holds Python's GIL for 5 s at step 4 (its renewals stop), with a 2 s TTL: the
    job finishes, equal to the uninterrupted run."""
    hog = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end: pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(2 * (os.cpu_count() or 1))]
    addresses = [s.address for s in servers(2)]
    args = [[str(STEPS), str(PAUSE_S)], [str(STEPS), str(PAUSE_S), "4", "5"]]
    procs = start_ranks(addresses, unique_id(), args, **{LEASE_TTL_ENV: "2"})
    try:
        outs = finish(procs, timeout=600)
    finally:
        stop_all(procs)
        for h in hogs:
            h.kill()
            h.wait(10)
    assert params_of(outs[0]) == params_of(outs[1]) == reference


@pytest.mark.slow
def test_a_killed_rank_is_named_within_seconds(servers):
    """SIGKILL rank 1 at step 3 (the TTL is the default 30 s): rank 0's next step ends with
    "rank 1 lost" within seconds."""
    addresses = [s.address for s in servers(2)]
    procs = start_ranks(addresses, unique_id(), [[str(STEPS), str(PAUSE_S)]] * 2)
    try:
        wait_for_line(procs[1], "step 3")
        killed = time.monotonic()
        os.kill(procs[1].pid, signal.SIGKILL)
        out, _ = procs[0].communicate(timeout=120)
    finally:
        stop_all(procs)
    failed = next(ln for ln in out.splitlines() if ln.startswith("FAILED "))
    at, error = failed.split(" ", 2)[1:]
    assert "rank 1 lost" in error, error
    print(f"rank 0 learned {float(at) - killed:.2f} s after the kill: {error}")
    assert float(at) - killed < KILL_NOTICE_S
