"""The lapse check at the end of a stream's grace (server/collectives/lease_checks.py).

A ``HoldLease`` handler used to wait out the grace (``STREAM_GRACE_S``, 1 s) in its own thread
after its stream ended, while the admission gate had already given the stream's session place
back. A caller that opened and dropped lease streams in a loop so held a thread a stream for a
second each, past the bound of sessions, and another team's renewals queued behind them until
they missed their deadlines (a hostile review: with the default limits, 256 such threads turned
a 2 ms renewal into DEADLINE_EXCEEDED). Now one thread runs every run's due checks.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import grpc
from conftest import worker_env

from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.lease_checks import DueChecks


def test_due_checks_run_in_due_order_never_early_and_fold_a_runs_close_ones():
    seen: list[tuple[str, float]] = []
    done = threading.Event()

    def check(run: str) -> None:
        seen.append((run, time.monotonic()))
        if len(seen) == 3:
            done.set()

    due = DueChecks(check)
    start = time.monotonic()
    due.at("a", 0.3)
    due.at("b", 0.1)
    due.at("a", 0.32)  # within COALESCE_S of a's first: folded into it
    assert done.wait(10.0)
    time.sleep(0.3)  # nothing more comes
    assert [run for run, _ in seen] == ["b", "a", "a"]  # a once at its time, once at 0.32
    assert seen[2][1] - start >= 0.32  # the folded check does not run before it is due
    due.stop()
    due.at("c", 0.0)  # stopped: nothing more is checked
    time.sleep(0.2)
    assert len(seen) == 3


_CHURN = textwrap.dedent(
    """
    import sys, threading, time
    import grpc
    from paramshard.protos import shard_pb2 as pb

    channel = grpc.insecure_channel(sys.argv[1])
    hold = channel.unary_stream(
        "/paramshard.v1.Shard/HoldLease",
        request_serializer=pb.LeaseRequest.SerializeToString,
        response_deserializer=pb.LeaseReply.FromString,
    )
    end = time.monotonic() + float(sys.argv[2])

    def churn(k):
        for n in range(100_000):
            if time.monotonic() > end:
                return
            call = hold(pb.LeaseRequest(run="churn", rank=(k + n) % 64, world_size=64,
                                        ttl_ms=30_000, holder="churner", client=1))
            try:
                next(call)
            except grpc.RpcError:
                pass  # refused at the bound of sessions
            call.cancel()

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(int(sys.argv[3]))]
    for t in threads:
        t.start()
    print("ready", flush=True)
    for t in threads:
        t.join()
    channel.close()
    """
)


def test_streams_dropped_in_a_loop_do_not_starve_other_callers(servers):
    (srv,) = servers(1, local_calls=False, max_workers=4, reserved_workers=1, max_sessions=2)
    churn = subprocess.Popen(
        [sys.executable, "-c", _CHURN, srv.address, "8", "32"],
        env=worker_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    channel = grpc.insecure_channel(srv.address)
    try:
        assert churn.stdout is not None and churn.stdout.readline().strip() == "ready"
        time.sleep(1.5)  # the churn is under way: before, the pool's threads were all held
        renew = channel.unary_unary(
            "/paramshard.v1.Shard/Lease",
            request_serializer=pb.LeaseRequest.SerializeToString,
            response_deserializer=pb.LeaseReply.FromString,
        )
        for _ in range(3):  # a renewal's deadline is at most 1 s (client/leases.py); 3 here
            renew(pb.LeaseRequest(run="other", world_size=2, ttl_ms=30_000), timeout=3.0)
            time.sleep(0.3)
        assert churn.poll() is None, "the churn ended before the renewals: nothing was shown"
    finally:
        channel.close()
        churn.kill()
        churn.wait()
