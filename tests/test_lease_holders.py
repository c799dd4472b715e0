"""One process a rank (server/collectives/lease_requests.py, ``check_holder``; client/leases.py).

Two jobs that set the same run id by mistake on shared servers used to meet in the same slots:
a contribution from the second job's rank 0 reads to the server as the first job's rank 0
(a retry), and sums that mixed both jobs failed nowhere. Every lease request now names its
process; while a rank's lease is held through an open stream, the servers refuse it to any
other process, and a new client raises ``LeaseConflict`` before its first collective. A
restarted rank, whose old process died, takes its rank over.

The table's rules are checked on a fake clock; then real servers and processes: a second job's
rank is refused while the first job trains on untouched, and a restart whose old process dies
while it asks is let in."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import unique_id, worker_env
from lease_fakes import Stream, new_table

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.run_state import Notice, RunState
from paramshard.protos import shard_pb2 as pb
from paramshard.server.runtime.errors import ShardError


def lease(holder: str, rank: int = 0, **kw) -> pb.LeaseRequest:
    return pb.LeaseRequest(run="r", rank=rank, world_size=2, ttl_ms=2000, holder=holder, **kw)


@pytest.mark.parametrize(
    "second",
    [
        lease("job-b"),
        lease("job-b", release=True),
        lease("job-b", abort="job b lost a server"),
        lease("job-b", epoch=3),
    ],
    ids=["renewal", "release", "abort", "later-epoch"],
)
def test_another_process_is_refused_while_the_holders_stream_is_open(second):
    leases, clock = new_table()
    mine = Stream(rank=0)
    leases.open_hold(lease("job-a"), mine)
    leases.renew(lease("job-a", rank=1))
    before = vars(leases._runs["r"].leases[0]).copy()
    clock.now += 0.5
    calls = [lambda: leases.renew(second)]
    if not second.release and not second.abort:  # HoldLease refuses those as malformed
        calls.append(lambda: leases.open_hold(second, Stream(rank=0)))
    for call in calls:
        with pytest.raises(ShardError) as refused:
            call()
        assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
        words = refused.value.message
        assert "rank 0 of run 'r' is held by another process (job-a)" in words, words
        assert "this one is job-b" in words and "Two jobs share the run id" in words, words
    run = leases._runs["r"]
    assert vars(run.leases[0]) == before  # the holder's lease is untouched
    assert run.aborted_epoch == -1 and not mine.pushed  # nothing was aborted
    assert leases.renew(lease("job-a")).aborted == ""  # the holder goes on


def test_a_restarted_process_takes_the_rank_over_once_the_old_streams_ended():
    """The server tells the new process that it took the rank over (``took_over``: a restart,
    whoever started it), in its first answer only; never a rank's first process, nor the
    holder's own renewals."""
    leases, clock = new_table()
    old = Stream(rank=0)
    assert not leases.open_hold(lease("old"), old).took_over  # the rank's first process
    assert not leases.renew(lease("peer", rank=1)).took_over
    assert not leases.renew(lease("old")).took_over
    assert leases.end_hold(old)  # the old process died: its kernel closed the connection
    clock.now += 0.5  # within the grace: the run waits for it
    new = Stream(rank=0)
    reply = leases.open_hold(lease("new"), new)
    assert reply.aborted == "" and reply.took_over
    assert leases._runs["r"].leases[0].holder == "new"
    assert not leases.renew(lease("new")).took_over  # said once
    with pytest.raises(ShardError) as late:  # the old process's last renewal, handled late
        leases.renew(lease("old", stream=True))
    assert late.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert leases.renew(lease("peer", rank=1)).aborted == ""


def test_a_rank_that_released_is_taken_over_by_another_process_not_by_its_own():
    """A rank's process released its lease (it raised, or closed its client) and the run goes
    on: a new process of the rank is a restart; a new client in the same process is not."""
    leases, _ = new_table()
    leases.renew(lease("peer", rank=1))
    leases.renew(lease("first"))
    leases.renew(lease("first", release=True))
    assert not leases.renew(lease("first")).took_over  # the same process, a new client
    leases.renew(lease("first", release=True))
    assert leases.renew(lease("second")).took_over


def test_a_holder_that_renews_after_its_stream_broke_is_not_taken_over():
    """A blip reset rank 0's stream; its client renews at once, before its next stream opens.
    Another process asking then is a second job, not a restart: refused. Once the holder's
    next stream opened and ended (it died), a restart takes the rank over."""
    leases, clock = new_table()
    first = Stream(rank=0)
    leases.open_hold(lease("job-a"), first)
    leases.renew(lease("peer", rank=1))
    assert leases.end_hold(first)
    clock.now += 0.3
    leases.renew(lease("job-a"))  # it knows its stream broke: a renewal without one
    with pytest.raises(ShardError) as refused:
        leases.open_hold(lease("job-b"), Stream(rank=0))
    assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert "(job-a) renewing it (its stream broke)" in refused.value.message
    assert leases._runs["r"].leases[0].holder == "job-a"
    again = Stream(rank=0)
    leases.open_hold(lease("job-a"), again)  # its next stream
    assert leases.end_hold(again)  # and then its process died
    clock.now += 0.5
    leases.open_hold(lease("job-b"), Stream(rank=0))
    assert leases._runs["r"].leases[0].holder == "job-b"


def test_requests_without_a_holder_do_not_refuse_but_are_refused_by_a_named_stream():
    """Older clients send no holder. Their streams refuse nobody; but a request without a
    holder for a rank a named process holds through a stream is refused: it would release
    the rank, or (another world size, a run of one rank) start a new run in its place."""
    leases, _ = new_table()
    leases.open_hold(lease(""), Stream(rank=0))
    leases.renew(lease("new"))  # an older client's stream does not refuse a named process
    leases.open_hold(lease("new", rank=1), Stream(rank=1))
    before = vars(leases._runs["r"].leases[1]).copy()
    for unnamed in (lease("", rank=1), lease("", rank=1, release=True)):
        with pytest.raises(ShardError) as refused:
            leases.renew(unnamed)
        assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert "this one is unnamed (an older client)" in refused.value.message
    assert vars(leases._runs["r"].leases[1]) == before
    alone = pb.LeaseRequest(run="solo", rank=0, world_size=1, ttl_ms=2000, holder="h x1")
    leases.open_hold(alone, Stream(run="solo", rank=0))
    with pytest.raises(ShardError):  # a run of one rank, asked with another world size
        leases.renew(pb.LeaseRequest(run="solo", rank=0, world_size=4, ttl_ms=2000))
    assert leases._runs["solo"].world_size == 1


def test_a_refusal_shows_the_holder_without_its_random_part():
    """``holder_id`` ends in a random part, which another process would need to pass for the
    holder (and release or abort its rank): a refusal names the host and pid only."""
    leases, _ = new_table()
    leases.open_hold(lease("hostA pid 7 1f2e3d4c"), Stream(rank=0))
    with pytest.raises(ShardError) as refused:
        leases.renew(lease("hostB pid 9 aabbccdd"))
    words = refused.value.message
    assert "held by another process (hostA pid 7)" in words and "this one is hostB pid 9." in words
    assert "1f2e3d4c" not in words and "aabbccdd" not in words, words


def test_a_holder_too_long_is_refused_as_malformed():
    leases, _ = new_table()
    with pytest.raises(ShardError) as refused:
        leases.renew(lease("x" * 300))
    assert (
        refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "holder" in refused.value.message
    )
    assert not leases._runs


def test_a_refused_rank_fails_every_wait_on_its_peers_at_every_epoch():
    state = RunState()
    state.refuse("server 0 (x): rank 0 of run 'r' is held by another process")
    assert state.current() is not None and not state.current().recoverable
    state.advance(7)  # restart_collectives moves on: the refusal stays
    assert "held by another process" in state.current().reason
    state.abort(Notice("run 'r' aborted: rank 1 lost", 9))  # a later notice does not replace it
    assert "held by another process" in state.current().reason


_CLAIM = textwrap.dedent(
    """
    import os, sys, time
    from paramshard.client import ClusterSpec, LeaseConflict, ShardClient

    spec = ClusterSpec(os.environ["ADDRESSES"].split(","))
    print("asking", flush=True)
    try:
        c = ShardClient(spec, rank=int(os.environ["RANK"]), world_size=2, run_id=os.environ["RUN"])
    except LeaseConflict as exc:
        print("refused", exc, flush=True)
        sys.exit(3)
    print("held", time.time(), flush=True)
    if os.environ.get("HOLD"):
        time.sleep(120)
    c.close()
    """
)


def _claim(addresses: str, run: str, rank: int, hold: bool = False) -> subprocess.Popen:
    env = {**worker_env(), "ADDRESSES": addresses, "RUN": run, "RANK": str(rank)}
    env = {**env, "GRPC_VERBOSITY": "ERROR", **({"HOLD": "1"} if hold else {})}
    return subprocess.Popen(
        [sys.executable, "-c", _CLAIM],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 60.0) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_second_job_under_the_same_run_id_is_refused_and_the_first_trains_on(servers):
    nodes = servers(2)
    addresses = [n.address for n in nodes]
    run = unique_id("shared")
    spec = ClusterSpec(addresses)
    first = [ShardClient(spec, rank=r, world_size=2, run_id=run) for r in (0, 1)]
    try:
        began = time.monotonic()
        out, err = _finish(_claim(",".join(addresses), run, rank=1))
        assert out.startswith("asking\nrefused"), (out, err[-2000:])
        assert f"pid {os.getpid()}" in out and "Two jobs share the run id" in out, out
        assert "Two jobs share the run id" not in err, err[-2000:]  # raised, not logged too
        assert time.monotonic() - began < 60
        with ThreadPoolExecutor(2) as pool:  # the first job's sums are its own, as before
            sums = list(pool.map(lambda c: c.all_reduce(np.full(4, c.rank + 1.0)), first))
        assert all(np.array_equal(s, np.full(4, 3.0)) for s in sums), sums
        assert all(c.run_state.current() is None for c in first)
    finally:
        for c in first:
            c.close()


def test_a_restart_whose_old_process_dies_while_it_asks_takes_the_rank(servers):
    addresses = ",".join(n.address for n in servers(1))
    run = unique_id("restart")
    old = _claim(addresses, run, rank=0, hold=True)
    new = None
    try:
        assert old.stdout.readline() == "asking\n" and old.stdout.readline().startswith("held")
        new = _claim(addresses, run, rank=0)
        assert new.stdout.readline() == "asking\n"
        time.sleep(1.0)  # the new process is refused meanwhile: the old one holds its stream
        killed_at = time.time()
        os.kill(old.pid, signal.SIGKILL)
        out, err = _finish(new)
        assert new.returncode == 0 and out.startswith("held"), (out, err[-2000:])
        assert float(out.split()[1]) > killed_at  # it held the rank only after the kill
    finally:
        for proc in (old, new):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_a_restarted_rank_hears_of_its_predecessors_loss_as_that_not_as_news(servers, caplog):
    """The servers end the epoch when a rank's process dies (here without restarts, at once);
    the process that takes its rank next finds that notice in its lease's first answers. It
    names this very rank lost: logged as its previous process's, at info, not as a loss."""
    addresses = [n.address for n in servers(1)]
    run = unique_id("predecessor")
    peer = ShardClient(ClusterSpec(addresses), rank=0, world_size=2, run_id=run)
    old = _claim(",".join(addresses), run, rank=1, hold=True)
    new = None
    try:
        assert old.stdout.readline() == "asking\n" and old.stdout.readline().startswith("held")
        caplog.set_level(logging.INFO, logger="paramshard.leases")
        os.kill(old.pid, signal.SIGKILL)
        old.communicate()
        deadline = time.monotonic() + 30
        while peer.run_state.refresh() is None:  # the peer hears it: news to it, a warning
            assert time.monotonic() < deadline, "the servers never ended the epoch"
            time.sleep(0.1)
        assert "rank 1 lost" in peer.run_state.current().reason
        assert [r for r in caplog.records if r.levelno == logging.WARNING], caplog.text
        caplog.clear()
        new = ShardClient(ClusterSpec(addresses), rank=1, world_size=2, run_id=run)
        assert new.run_state.current() is not None  # it did hear of the ended epoch
        said = [r for r in caplog.records if "rank 1 lost" in r.getMessage()]
        assert said and all(r.levelno == logging.INFO for r in said), caplog.text
        assert "this rank's previous process" in said[0].getMessage()
    finally:
        for c in (peer, new):
            if c is not None:
                c.close()
        if old.poll() is None:
            old.kill()
            old.communicate()
