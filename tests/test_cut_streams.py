"""Streams and callers cut mid-flight (round ten, docs/security.md). Found by a hostile review;
each test failed before its fix:

- A DropJob of a live run left its ranks' lease streams with the forgotten run: a rank's death
  was then found by its renewal's lapse (30 s, not 1 s), and another process could take its
  rank while its stream was open.
- A session whose reader was held back by its bounds, cancelled by its client, stayed open
  with its calls and bytes until one of its calls ended (up to ``--max-wait-s``).
- A cancelled session's calls waiting in line stayed there, their requests held, until the
  sweep, while the sessions' byte count had dropped them at once.
- A session half-closed by its client ended at once, dropping the replies of its calls in
  flight.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import unique_id
from lease_fakes import KILL_NOTICE_S, Stream, lease, new_table
from test_liveness import holding_rank
from test_sessions import SESSION, RawSession, call, code_of, contribution, read

from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.transport import session_stream

pytestmark = pytest.mark.timeout(180)
TOKENS = {"tok-a": "train", "tok-b": "train"}
SETTLE_S = 10.0  # a bounded wait for what the server does on its own threads


def until(check: Callable[[], Any], what: str, within: float = SETTLE_S) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"not within {within:g} s: {what}"
        time.sleep(0.05)


# -- lease streams of a dropped run -------------------------------------------------------------
def test_dropping_a_run_ends_its_lease_streams() -> None:
    leases, _ = new_table()
    streams = [Stream(rank=0), Stream(rank=1)]
    for r, s in enumerate(streams):
        leases.open_hold(lease(r), s)
    assert leases.drop("r")
    assert all(s.stopped for s in streams)  # before: open, held by no run
    assert not any(leases.end_hold(s) for s in streams)  # their end decides nothing


def test_after_a_drop_job_a_killed_rank_is_still_lost_within_seconds(servers) -> None:
    """Real clients: rank 1 (a process) holds its stream; DropJob of the run; its client
    opens the stream again on the run's new record; SIGKILL: rank 0 learns within
    ``KILL_NOTICE_S`` (before: 30 s, a renewal's lapse), and until then nobody else takes
    rank 1."""
    (srv,) = servers(1)
    run = unique_id()
    proc = holding_rank(srv.address, run)
    client = ShardClient(ClusterSpec([srv.address]), rank=0, world_size=2, run_id=run)
    table = srv.servicer.leases
    first = table._runs.get(run)

    def streams_of_rank_1(record: Any = None) -> int:
        found = table._runs.get(run)
        if found is None or (record is not None and found is record):
            return 0
        held = found.leases.get(1)
        return held.holds if held is not None else 0

    try:
        client.all_reduce(np.ones(3, dtype=np.float32))
        assert proc.stdout.readline().strip() == "holding"
        until(streams_of_rank_1, "rank 1's stream held")
        first = table._runs[run]
        srv.servicer.drop_job(pb.DropJobRequest(job=run), None)
        until(lambda: streams_of_rank_1(first), "rank 1's stream held again, on the new record")
        intruder = pb.LeaseRequest(run=run, rank=1, world_size=2, ttl_ms=30000, holder="other")
        with pytest.raises(ShardClientError) as refused:
            client.call(0, "Lease", intruder)
        assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS  # before: OK
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        until(client.run_state.current, "rank 0 told of rank 1's loss", within=40)
        learned = time.monotonic() - killed
        notice = client.run_state.current()
        assert notice.lost_rank == 1 and "stream to this server closed" in notice.reason
        assert learned < KILL_NOTICE_S, f"learned after {learned:.1f} s"
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


# -- sessions cancelled while their calls wait -------------------------------------------------
def push_body(numel: int, contributor: int) -> bytes:
    header = pb.PushGradHeader(
        ref=pb.BufferRef(job="lj", buffer="w"),
        chunk=pb.Chunk(offset=0, numel=numel, dtype=codec.wire_dtype("float32")),
        step=0,
        contributor=contributor,
        num_micro=1,
    )
    return codec.encode(header, np.ones(numel, np.float32))


NUMEL = 16384  # 64 KiB a push


@pytest.mark.parametrize("held_back", [False, True])
def test_a_cancelled_sessions_calls_in_line_go_with_it(monkeypatch, held_back: bool) -> None:
    """Token a's first session fills the token's share of waiting threads with reads that
    never complete; its second sends pushes to a buffer without initial values, which wait
    in line. ``held_back``: the session's bound on request bytes (made 4 pushes here) stops
    its reader too. The second session is then cancelled: it closes at once, its calls leave
    the line, and the bytes they held leave the count."""
    if held_back:
        monkeypatch.setattr(session_stream, "MAX_HELD_BYTES", 4 * NUMEL * 4)
    with ShardServer(local_calls=False, max_workers=8, reserved_workers=2, tokens=TOKENS) as srv:
        c = ShardClient(ClusterSpec([srv.address], token="tok-a"), timeout_s=15, sessions=False)
        first = RawSession(srv.address, "tok-a")
        victim = RawSession(srv.address, "tok-a")
        try:
            c.register_buffer("lj", "w", NUMEL, contributors=64)  # never initialised
            first.opened()
            bound = srv.gate.caller_bound
            first.send(*[call(i, "ReadSlot", read(f"lj:never{i}/0"), 60) for i in range(bound)])
            until(lambda: srv.gate.waiting_of("tok-a") == bound, "the token's share taken")
            victim.opened()
            victim.send(*[call(100 + i, "PushGrad", push_body(NUMEL, i), 60) for i in range(8)])
            taken = 4 if held_back else 8
            until(lambda: len(srv.sessions.line) == taken, f"{taken} pushes in line")
            assert srv.sessions.open == 2
            victim.close()
            until(lambda: srv.sessions.open == 1, "the cancelled session closed")
            assert len(srv.sessions.line) == 0  # before: the pushes stayed until the sweep
            reads = sum(len(read(f"lj:never{i}/0")) for i in range(bound))
            assert srv.sessions.held_bytes == reads  # the first session's alone
        finally:
            victim.close()
            first.close()
            c.close()


def test_a_half_closed_session_still_gets_its_replies() -> None:
    """A client that ends its side of the stream and reads on gets the replies of the calls
    it sent (gRPC's half-close); before, the stream ended OK at once, without them."""
    with ShardServer(local_calls=False) as srv:
        with grpc.insecure_channel(srv.address) as channel:
            out: queue.SimpleQueue[Any] = queue.SimpleQueue()
            stream = channel.stream_stream(SESSION)(iter(out.get, None), timeout=30)
            assert pb.SessionBatch.FromString(next(stream)).calls == []
            out.put(
                pb.SessionBatch(
                    calls=[call(1, "ReadSlot", read("hc:ar/0"), 20)]
                ).SerializeToString()
            )
            time.sleep(0.3)  # the read waits for its contribution
            out.put(None)  # half-close: no more calls, the replies are still read
            other = RawSession(srv.address)
            try:
                other.opened()
                other.send(call(7, "Contribute", contribution("hc:ar/0", np.ones(4, np.float32))))
                assert code_of(other.replies(1)[7]) == grpc.StatusCode.OK
            finally:
                other.close()
            replies = [c for raw in stream for c in pb.SessionBatch.FromString(raw).calls]
            assert [(r.id, code_of(r)) for r in replies] == [(1, grpc.StatusCode.OK)]
