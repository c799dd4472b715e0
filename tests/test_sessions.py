"""Sessions: one stream per client and server carrying data-plane calls
(server/transport/sessions.py, client/session.py).

The collectives and buffer tests run over sessions already (the ``transport`` matrix of
conftest.py); here: what a session does that unary calls do not, and what a hostile or broken
caller can do with one. Real servers on 127.0.0.1, called through gRPC (``local_calls=False``).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from test_shm import client as shm_client
from test_shm import open_segment, push

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.rpc import Call
from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.transport import session_stream

SESSION = "/paramshard.v1.Shard/Session"
TOKENS = {"tok-train": "train", "tok-read": "read"}


@pytest.fixture
def server() -> Iterator[ShardServer]:
    s = ShardServer(local_calls=False).start()
    yield s
    s.stop(0)


class RawSession:
    """A session driven by hand: batches in, batches out, nothing checked on our side."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.channel = grpc.insecure_channel(address)
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        stub = self.channel.stream_stream(SESSION)  # raw bytes both ways
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.call = stub(iter(self.out.get, None), metadata=metadata, timeout=30)

    def send(self, *calls: pb.SessionCall) -> None:
        self.out.put(pb.SessionBatch(calls=calls).SerializeToString())

    def send_raw(self, raw: bytes) -> None:
        self.out.put(raw)

    def replies(self, n: int) -> dict[int, pb.SessionCall]:
        """The next ``n`` replies, by call id (after the empty batch that opens)."""
        got: dict[int, pb.SessionCall] = {}
        while len(got) < n:
            batch = pb.SessionBatch.FromString(next(self.call))
            got.update((c.id, c) for c in batch.calls)
        return got

    def opened(self) -> None:
        assert pb.SessionBatch.FromString(next(self.call)).calls == []

    def close(self) -> None:
        self.out.put(None)
        self.call.cancel()
        self.channel.close()


def contribution(key: str, values: np.ndarray, expected: int = 1, readers: int = 1) -> bytes:
    header = pb.SlotHeader(
        key=key,
        op=pb.SUM,
        expected=expected,
        readers=readers,
        total_numel=values.size,
        chunk=pb.Chunk(offset=0, numel=values.size, dtype=codec.wire_dtype("float32")),
        chunk_numel=values.size,
    )
    return codec.encode(header, values)


def read(key: str, reader: int = 0) -> bytes:
    return pb.ReadSlotRequest(key=key, reader=reader).SerializeToString()


def call(i: int, method: str, body: bytes, timeout_s: float = 10.0) -> pb.SessionCall:
    return pb.SessionCall(id=i, method=method, body=body, timeout_s=timeout_s)


def code_of(reply: pb.SessionCall) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == reply.code)


def test_a_contribution_and_its_read_in_one_batch(server) -> None:
    s = RawSession(server.address)
    try:
        s.opened()
        values = np.arange(4, dtype=np.float32)
        s.send(
            call(1, "Contribute", contribution("r:ar1/0", values)),
            call(2, "ReadSlot", read("r:ar1/0")),
        )
        got = s.replies(2)
        assert got[1].code == 0 and got[2].code == 0
        header, data = codec.decode(got[2].body, pb.SlotHeader)
        np.testing.assert_array_equal(np.frombuffer(data, np.float32), values)
        assert server.sessions.calls == 2
    finally:
        s.close()


def test_errors_come_back_per_call_and_the_session_goes_on(server) -> None:
    s = RawSession(server.address)
    try:
        s.opened()
        s.send(
            call(1, "Status", b""),  # a control-plane method: never in a session
            call(2, "NoSuchMethod" * 20, b""),
            call(3, "Contribute", b"\xff\xff\xff"),  # does not parse
            call(4, "ReadSlot", pb.ReadSlotRequest(key="").SerializeToString()),
            call(5, "ReadSlot", read("r:never/0"), timeout_s=0.3),  # nobody contributes
        )
        got = s.replies(5)
        assert code_of(got[1]) == grpc.StatusCode.UNIMPLEMENTED and "Status" in got[1].details
        assert code_of(got[2]) == grpc.StatusCode.UNIMPLEMENTED and len(got[2].details) < 300
        assert code_of(got[3]) == grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(got[4]) == grpc.StatusCode.INVALID_ARGUMENT and "key" in got[4].details
        assert code_of(got[5]) == grpc.StatusCode.DEADLINE_EXCEEDED
        values = np.ones(3, np.float32)  # the same stream still works
        s.send(
            call(6, "Contribute", contribution("r:ok/0", values)),
            call(7, "ReadSlot", read("r:ok/0")),
        )
        got = s.replies(2)
        assert got[6].code == 0 and got[7].code == 0
    finally:
        s.close()


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -1.0, 0.0])
def test_a_meaningless_deadline_is_the_servers_own(timeout_s) -> None:
    with ShardServer(local_calls=False, max_wait_s=0.3) as server:
        s = RawSession(server.address)
        try:
            s.opened()
            s.send(call(1, "ReadSlot", read("r:never/0"), timeout_s=timeout_s))
            began = time.monotonic()
            got = s.replies(1)
            assert code_of(got[1]) == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - began < 5
        finally:
            s.close()


def test_a_calls_deadline_counts_from_its_arrival_not_from_when_a_thread_takes_it() -> None:
    """A waiting call queued behind a busy pool (here: its thread comes 0.6 s late) has waited
    that long already: its handler starts with the rest of its 1 s, not a whole second."""
    with ShardServer(local_calls=False) as server:
        pool, sessions = server.sessions.pool, server.sessions
        submit, left = pool.submit, []

        def late(fn, *args):
            time.sleep(0.6)  # a pool whose threads are all taken, for a while
            return submit(fn, *args)

        fn, parse, serialize = sessions.handlers["ReadSlot"]

        def read_slot(request, context):
            left.append(context.time_remaining())
            return fn(request, context)

        pool.submit = late
        sessions.handlers["ReadSlot"] = (read_slot, parse, serialize)
        s = RawSession(server.address)
        try:
            s.opened()
            s.send(call(1, "ReadSlot", read("r:never/0"), timeout_s=1.0))
            assert code_of(s.replies(1)[1]) == grpc.StatusCode.DEADLINE_EXCEEDED
            assert left and left[0] <= 0.45, left
        finally:
            s.close()


def test_bytes_that_do_not_parse_end_the_session_not_the_server(server) -> None:
    s = RawSession(server.address)
    s.opened()
    s.send_raw(b"\x0a\xff\xff\xff\xff")  # a truncated field
    with pytest.raises(grpc.RpcError) as err:
        s.replies(1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in err.value.details()
    s.close()
    c = ShardClient(ClusterSpec([server.address]), timeout_s=10)
    try:
        assert c.all_reduce(np.ones(2, np.float32)).tolist() == [1.0, 1.0]
    finally:
        c.close()


@pytest.mark.parametrize("kind", ["max_sessions=0", "interceptors"])
def test_servers_without_sessions_get_unary_calls(kind) -> None:
    kw = {"max_sessions": 0} if kind == "max_sessions=0" else {"interceptors": [PassThrough()]}
    with ShardServer(local_calls=False, **kw) as server:
        c = ShardClient(ClusterSpec([server.address]), timeout_s=10)
        try:
            assert c.all_reduce(np.ones(2, np.float32)).tolist() == [1.0, 1.0]
        finally:
            c.close()
        assert server.sessions.calls == 0


class PassThrough(grpc.ServerInterceptor):
    def intercept_service(self, continuation: Any, details: Any) -> Any:
        return continuation(details)


def test_closing_the_client_closes_its_sessions(server) -> None:
    c = ShardClient(ClusterSpec([server.address]), timeout_s=10)
    c.all_reduce(np.ones(2, np.float32))
    assert server.gate.sessions == 1
    c.close()
    deadline = time.monotonic() + 5
    while server.gate.sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.gate.sessions == 0


def test_a_stopping_server_ends_each_session_once_its_calls_have_replied(server) -> None:
    """``ShardServer.stop`` drains the sessions: a client's idle session used to hold the stop
    to its grace's end (5 s of every ``paramshard serve`` SIGTERM). A call in flight still
    replies, a call sent after is refused UNAVAILABLE (clients send it again), then the
    session ends UNAVAILABLE; a session opened after ends at once."""
    s = RawSession(server.address)
    try:
        s.opened()
        s.send(call(1, "ReadSlot", read("r:late/0"), timeout_s=30.0))  # waits for a sum
        deadline = time.monotonic() + 10
        while server.gate.waiting["train"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.gate.waiting["train"] == 1  # in flight, waiting
        server.sessions.drain("this server is stopping")
        s.send(call(2, "ReadSlot", read("r:other/0")))
        refused = s.replies(1)[2]
        assert code_of(refused) == grpc.StatusCode.UNAVAILABLE, refused
        with grpc.insecure_channel(server.address) as channel:  # unary calls still come in
            contribute = channel.unary_unary("/paramshard.v1.Shard/Contribute")
            contribute(contribution("r:late/0", np.arange(3, dtype=np.float32)), timeout=10)
        got = s.replies(1)[1]
        assert code_of(got) == grpc.StatusCode.OK, got
        with pytest.raises(grpc.RpcError) as ended:
            s.replies(1)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "this server is stopping" in ended.value.details()
    finally:
        s.close()
    late = RawSession(server.address)
    try:
        with pytest.raises(grpc.RpcError) as refused_at_once:
            late.opened()
        assert refused_at_once.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        late.close()


def test_a_session_sends_the_calls_made_together_in_one_batch(server, monkeypatch) -> None:
    """A contribution and a read queued together (as a reduce-scatter queues its contributions
    and the read of its own slice) reach the server as one batch (the client queues the second
    long before grpcio's sender thread gets the GIL)."""
    seen: list[int] = []
    real = session_stream.SessionStream.read

    def counting(self: Any, batches: Any) -> None:
        def spy() -> Any:
            for batch in batches:
                seen.append(len(batch))
                yield batch

        real(self, spy())

    monkeypatch.setattr(session_stream.SessionStream, "read", counting)
    c = ShardClient(ClusterSpec([server.address]), timeout_s=10)
    try:
        for i in range(20):
            key, chunk = f"batch:{i}", pb.Chunk(offset=0, numel=2, dtype=pb.FLOAT32)
            h = pb.SlotHeader(key=key, op=pb.SUM, expected=1, readers=1, total_numel=2,
                              chunk_numel=2, chunk=chunk)  # fmt: skip
            read = pb.ReadSlotRequest(key=key, offset=0, reader=0)
            _, (_, got) = c.run(
                [Call(0, "Contribute", (h, np.ones(2, np.float32))), Call(0, "ReadSlot", read)]
            )
            assert np.frombuffer(got, np.float32).tolist() == [1.0, 1.0]
        assert sum(seen) == 40
        assert seen.count(2) >= 10, seen
    finally:
        c.close()


def test_a_segment_of_another_token_is_refused_in_a_session_too() -> None:
    """A session's calls name segments as their stream's token: tok-b's session cannot push
    from tok-a's segment, and the slice is untouched."""
    s = ShardServer(local_calls=False, tokens={"tok-a": "train", "tok-b": "train"}).start()
    values = np.arange(2**16, dtype=np.float32)
    owner = shm_client(s.address, "tok-a")
    owner.register_buffer("g", "w", values.size, hyper={"lr": 0.5})  # what push() names
    owner.set_params("g", "w", values)
    owner.close()
    segment, mapped = open_segment(s.address, "tok-a")
    mapped[: 2**18] = np.ones(2**16, np.float32).tobytes()
    session = RawSession(s.address, "tok-b")
    try:
        session.opened()
        session.send(call(1, "PushGrad", codec.serialize(push(segment, 2**18))))
        reply = session.replies(1)[1]
        assert code_of(reply) == grpc.StatusCode.FAILED_PRECONDITION
        assert "unknown here" in reply.details
    finally:
        session.close()
    c = shm_client(s.address, "tok-a", sessions=False)
    try:
        np.testing.assert_array_equal(c.pull_params("g", "w", values.size), values)
    finally:
        c.close()
        s.stop(0)
