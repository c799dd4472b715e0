"""Sessions seen from the client (client/session.py): a server restarted or started late gets
a session of its own, ranks on sessions and on unary calls agree, and a batch takes what is
ready and never waits for more. The raw protocol and hostile callers: tests/test_sessions.py.
Real servers on 127.0.0.1, called through gRPC (``local_calls=False``).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np
from conftest import port_to_reuse, run_ranks

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client import session as client_session
from paramshard.protos.batches import take_ready
from paramshard.server import ShardServer


def test_a_restarted_server_gets_a_new_session() -> None:
    """The session to a stopped server breaks; the call in flight is sent again and the next
    session is opened with the server that took its place."""
    port = port_to_reuse()
    first = ShardServer(port=port, local_calls=False).start()
    c = ShardClient(ClusterSpec([first.address]), timeout_s=20)
    try:
        assert c.all_reduce(np.ones(2, np.float32)).tolist() == [1.0, 1.0]
        first.stop(0)
        second = ShardServer(port=port, local_calls=False).start()
        try:
            assert c.all_reduce(np.full(2, 3.0, np.float32)).tolist() == [3.0, 3.0]
            # the all-reduce's one call (ContributeRead), failed in the broken session and
            # sent again: in the new one
            assert second.sessions.calls >= 1
        finally:
            second.stop(0)
    finally:
        c.close()


def test_a_server_that_starts_late_gets_a_session_soon_after() -> None:
    """A client's first call to a server still starting fails to open a session (UNAVAILABLE)
    and is retried one by one until the server is up; that is not a refusal, so the session is
    asked for again after ``RETRY_UNREACHABLE_S``, not the half minute of a refusal (a rank
    whose peer's server started a moment later used to call it one by one for 30 s)."""
    port = port_to_reuse()
    c = ShardClient(ClusterSpec([f"127.0.0.1:{port}"]), timeout_s=20, retries=20)
    late: list[ShardServer] = []
    starter = threading.Timer(
        0.5, lambda: late.append(ShardServer(port=port, local_calls=False).start())
    )
    starter.start()
    try:
        assert c.all_reduce(np.ones(2, np.float32)).tolist() == [1.0, 1.0]  # while it starts
        starter.join()
        before = late[0].sessions.calls  # its retries may have come after the server was up
        time.sleep(client_session.RETRY_UNREACHABLE_S)
        assert c.all_reduce(np.full(2, 3.0, np.float32)).tolist() == [3.0, 3.0]
        assert late[0].sessions.calls == before + 1  # its one call (ContributeRead), in a session
    finally:
        starter.join()
        c.close()
        for s in late:
            s.stop(0)


def test_two_ranks_sessions_and_unary_agree(servers) -> None:
    """The same collectives through sessions and through unary calls: bitwise equal."""
    addresses = [s.address for s in servers(2, local_calls=False)]
    rng = np.random.default_rng(0)
    data = [rng.standard_normal(1000).astype(np.float32) for _ in range(2)]

    def body(c: ShardClient) -> list[np.ndarray]:
        x = data[c.rank]
        return [c.all_reduce(x), c.reduce_scatter(x), *c.all_gather(x[: 10 + c.rank])]

    with_sessions = run_ranks(body, 2, addresses, run_id="with")
    without = run_ranks(body, 2, addresses, run_id="without", sessions=False)
    for a, b in zip(with_sessions, without, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_a_batch_holds_what_is_ready_and_never_waits_for_more() -> None:
    items: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for i in range(3):
        items.put(i)
    assert take_ready(items, None) == ([0, 1, 2], False)
    items.put(3)
    items.put(None)
    assert take_ready(items, None) == ([3], True)
    assert take_ready(items, None) == ([], True)  # the end stays
    items = queue.SimpleQueue()  # a batch ends at its bytes, the call that reaches them in it
    for i in (5, 1, 1, 9, 2):
        items.put(i)
    assert take_ready(items, None, max_bytes=6, size=int) == ([5, 1], False)
    assert take_ready(items, None, max_bytes=6, size=int) == ([1, 9], False)
    assert take_ready(items, None, max_bytes=6, size=int) == ([2], False)
