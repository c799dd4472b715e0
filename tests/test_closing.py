"""protos/closing.py's bound on one step of a close: a step left past it shortens the steps
after it only while it still runs.

A step that waits on a gRPC lock left taken never ends, and every later step would wait its
full bound on the same lock. But on a loaded machine a cancel can also just be slow (a 300-rank
process on two cores took over a second for one): once it ends, the closes after it must get
their full bound again, not be cut short for the rest of the process. And what the exit closes:
no gRPC call is left to the interpreter's teardown, and a forked worker closes nothing of its
parent's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

from conftest import worker_env

from paramshard.protos import closing


def run_child(code: str, timeout_s: float) -> subprocess.CompletedProcess:
    """``code`` in a Python process of its own (its exit is what is tested), output captured."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_a_slow_step_shortens_later_steps_only_while_it_runs(monkeypatch) -> None:
    monkeypatch.setattr(closing, "STEP_S", 0.2)
    release = threading.Event()
    assert closing.step_s() == 0.2

    assert closing.bounded(lambda: release.wait(30), "a slow step") is False
    assert closing.step_s() == closing.WEDGED_STEP_S  # it may be a lock left taken
    # a later step that ends in time is waited for, and does not clear the mark
    assert closing.bounded(lambda: None, "a quick step") is True
    assert closing.step_s() == closing.WEDGED_STEP_S

    release.set()  # it was only slow: it ends
    deadline = time.monotonic() + 10
    while closing.step_s() != 0.2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closing.step_s() == 0.2


def test_a_step_that_ends_in_time_is_waited_for(monkeypatch) -> None:
    monkeypatch.setattr(closing, "STEP_S", 5.0)
    ran = []
    assert closing.bounded(lambda: (time.sleep(0.05), ran.append(1)), "a step") is True
    assert ran == [1] and closing.step_s() == 5.0


_CHILD = textwrap.dedent(
    """
    import os, sys, threading
    import grpc
    import grpc._channel
    import numpy as np
    from paramshard.client import ClusterSpec, ShardClient
    from paramshard.server import ShardServer

    at_exit = grpc._channel._Rendezvous.__del__
    def reported(self):  # a gRPC call whose last reference goes in the interpreter's teardown
        if sys.is_finalizing():
            os.write(2, b"A GRPC CALL LEFT TO THE EXIT\\n")
        at_exit(self)
    grpc._channel._Rendezvous.__del__ = reported

    servers = [ShardServer(port=0).start() for _ in range(2)]
    spec = ClusterSpec([s.address for s in servers])
    clients = [ShardClient(spec, rank=r, world_size=2, run_id="exit") for r in range(2)]
    ranks = [threading.Thread(target=c.all_reduce, args=(np.ones(3, np.float32),)) for c in clients]
    [t.start() for t in ranks]
    [t.join() for t in ranks]
    for c in clients:  # closed, and kept to the end (a training script's globals)
        c.close()
    channel = grpc.insecure_channel(servers[0].address)
    failed = channel.unary_unary("/paramshard.v1.Shard/NoSuchMethod").future(b"")
    try:
        failed.result(10)  # raises itself: a cycle that only the garbage collector frees
    except grpc.RpcError as exc:
        print(exc.code().name, flush=True)
    del failed
    channel.close()
    for s in servers:
        s.stop(grace=None)
    """
)


def test_no_grpc_call_is_left_to_the_interpreters_teardown() -> None:
    """A closed client's streams (sessions, lease streams) and a call that raised are gone
    before the interpreter tears down: there a call's ``__del__`` takes a lock that a daemon
    thread, gone by then, may have held, and the process hung (once in about 80 rank exits
    on a loaded machine, each after its close). The child reports every call that reaches
    the teardown; before the fix its four lease streams did, every time."""
    proc = run_child(_CHILD, timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["UNIMPLEMENTED"]
    assert "A GRPC CALL LEFT TO THE EXIT" not in proc.stderr, proc.stderr[-2000:]


_FORKS = textwrap.dedent(
    """
    import multiprocessing as mp, sys, time
    from paramshard.client import ClusterSpec, ShardClient, membership
    from paramshard.protos import closing
    from paramshard.server import ShardServer

    def worker():  # its exit code: what its exit would close or leave of the parent's
        sys.exit(len(closing._open) + 10 * len(list(membership._registry._items)))

    server = ShardServer(port=0).start()
    spec = ClusterSpec([server.address])
    live = [ShardClient(spec, rank=r, world_size=2, run_id="forks") for r in range(2)]
    closed = ShardClient(spec, rank=1, world_size=2, run_id="forks-closed")
    peer = ShardClient(spec, rank=0, world_size=2, run_id="forks-closed")
    elastic = ShardClient(spec, rank=0, world_size=2, run_id="forks-elastic")
    member = membership.Membership(elastic, "e", min_members=1, window_s=1.0, wait_s=5.0)
    closed.close()  # as a script that closes its client and goes on, then forks
    workers = [mp.get_context("fork").Process(target=worker) for _ in range(3)]
    began = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    print("workers", [w.exitcode for w in workers], f"{time.monotonic() - began:.1f}", flush=True)
    for w in workers:
        if w.is_alive():
            w.kill()
    run = server.servicer.leases._runs["forks-closed"]
    print("ended", sorted(run.ended_at), flush=True)
    for c in (*live, peer, elastic):
        c.close()
    server.stop(grace=None)
    """
)


def test_a_forked_worker_leaves_its_parents_clients_alone() -> None:
    """A rank with clients open forks workers (a DataLoader's, a ``multiprocessing`` pool) that
    do nothing. Each exits at once, and none says the parent's closed rank ended. Before, a
    worker's exit closed the clients it inherited: it hung on a gRPC lock that a parent thread
    held at the fork (a DataLoader then waits 5 s for it and kills it: 5 s an epoch), and a
    worker of a rank that had closed its client told the server, in the rank's name, that it
    ended for good, which failed its peers' waits at once while it was still running. An
    elastic rank's membership is the parent's too: a child's exit left it, over the parent's
    channels, and the parent's next step went on without the rank (a review)."""
    proc = run_child(_FORKS, timeout_s=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    codes, took = lines["workers"].rsplit(" ", 1)
    # before: 16 each (6 closes: the server, 4 clients, the closed one's exit release; 1
    # membership), and 9.2 s for the three, each close waiting out its bound on a lock left
    # taken; None: hung for 30 s and killed
    assert codes == "[0, 0, 0]", (lines, proc.stderr[-2000:])
    assert float(took) < 30, lines
    assert lines["ended"] == "[]", lines  # the closed rank's parent still runs


_INTERRUPTED = textwrap.dedent(
    """
    from paramshard.protos import closing

    class Closes:
        def __init__(self, name, error=None):
            self.name, self.error = name, error

        def close(self):
            print("closed", self.name, flush=True)
            if self.error is not None:
                raise self.error

    objects = [Closes("first"), Closes("interrupted", KeyboardInterrupt()), Closes("last")]
    for obj in objects:
        closing.close_at_exit(obj, Closes.close)
    """
)


def test_a_ctrl_c_in_one_close_at_exit_leaves_the_others_closed() -> None:
    """A Ctrl-C (or a signal handler's ``sys.exit``) that lands in one close at the exit: the
    others still close, latest first. Before, the KeyboardInterrupt left the exit hook and the
    closes after it never ran (a review: a live client stayed unreleased, and its peers took
    its rank for lost)."""
    proc = run_child(_INTERRUPTED, timeout_s=60)
    assert proc.stdout.split("\n")[:3] == ["closed last", "closed interrupted", "closed first"]
    assert "KeyboardInterrupt; the rest are closed" in proc.stderr, proc.stderr
