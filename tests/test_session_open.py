"""Opening a session (client/session.py): what a client does when the server does not open
it in time. Real gRPC servers on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import grpc

from paramshard.client import ClusterSpec
from paramshard.client import session as client_session
from paramshard.protos import closing


def test_a_session_closed_for_opening_late_is_never_used(monkeypatch) -> None:
    """A session the server does not open within ``OPEN_TIMEOUT_S`` is closed, and its calls
    go one by one. Its close waits for its receiver a bounded time (``closing.step_s``): on a
    loaded machine that can pass before the receiver has seen the cancel, and the session,
    closed but not yet marked broken, was handed out as open; calls put into it were never
    sent, and waited until the receiver caught up, or for their deadline."""
    release = threading.Event()
    opened: list[int] = []

    def never_opens(requests: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        opened.append(1)
        release.wait(30)  # no first batch: the client's open times out
        return
        yield

    stub_server = grpc.server(ThreadPoolExecutor(4))
    stub_server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "paramshard.v1.Shard",
                {"Session": grpc.stream_stream_rpc_method_handler(never_opens)},
            ),
        )
    )
    port = stub_server.add_insecure_port("127.0.0.1:0")
    stub_server.start()
    spec = ClusterSpec([f"127.0.0.1:{port}"])
    monkeypatch.setattr(client_session, "OPEN_TIMEOUT_S", 0.3)
    monkeypatch.setattr(closing, "STEP_S", 0.0)  # the receiver's end is not waited for
    own = client_session.Sessions(on=True)
    try:
        assert own.get(SimpleNamespace(spec=spec), 0) is None
        assert own.get(SimpleNamespace(spec=spec), 0) is None  # refused: not asked again
        assert opened == [1]
    finally:
        release.set()
        own.close()
        spec.close()
        stub_server.stop(0)
        deadline = time.monotonic() + 10  # the steps left late end: later tests get STEP_S
        while closing.step_s() == closing.WEDGED_STEP_S and time.monotonic() < deadline:
            time.sleep(0.01)
