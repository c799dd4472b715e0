"""protos/closing.py's bound on one step of a close: a step left past it shortens the steps
after it only while it still runs.

A step that waits on a gRPC lock left taken never ends, and every later step would wait its
full bound on the same lock. But on a loaded machine a cancel can also just be slow (a 300-rank
process on two cores took over a second for one): once it ends, the closes after it must get
their full bound again, not be cut short for the rest of the process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

from conftest import worker_env

from paramshard.protos import closing


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
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["UNIMPLEMENTED"]
    assert "A GRPC CALL LEFT TO THE EXIT" not in proc.stderr, proc.stderr[-2000:]
