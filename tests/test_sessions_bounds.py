"""Sessions under hostile or greedy callers (server/transport/sessions.py, server/rpc/admission.py):
the bounds of a batch, of calls in flight and waiting, of replies a client does not read and of
requests it holds, of open sessions, and each call's role. The helpers are test_sessions.py's.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from test_sessions import (
    SESSION,
    TOKENS,
    RawSession,
    call,
    code_of,
    contribution,
    read,
)

from paramshard.client import ClusterSpec, ShardClient
from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.transport import (  # its bounds are patched where they are read
    session_stream,
    sessions,
)


@pytest.fixture
def server() -> Iterator[ShardServer]:
    s = ShardServer(local_calls=False).start()
    yield s
    s.stop(0)


def test_a_batch_past_its_bound_ends_the_session(server) -> None:
    s = RawSession(server.address)
    s.opened()
    s.send(*[call(i, "ReadSlot", read(f"r:x{i}/0"), 0.1) for i in range(sessions.MAX_BATCH + 1)])
    with pytest.raises(grpc.RpcError) as err:
        s.replies(1)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    s.close()


def test_a_message_of_millions_of_empty_calls_is_refused_unparsed(server) -> None:
    """Two bytes per empty call: 4 MB would be 2 million parsed calls; the reader stops at
    the bound, so the server's memory does not grow with them."""
    s = RawSession(server.address)
    s.opened()
    s.send_raw(b"\x0a\x00" * 2_000_000)
    with pytest.raises(grpc.RpcError) as err:
        s.replies(1)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"more than {sessions.MAX_BATCH} calls" in err.value.details()
    s.close()


def test_a_client_that_reads_no_replies_is_not_read_either(server) -> None:
    """Every bad call gets a reply; a client that never reads them must not make the server
    queue them without bound. Past MAX_UNSENT replies the server stops reading the stream,
    so gRPC's flow control stops the client's sends: of 400 batches offered (1024 bad calls
    each, 0.4 GB of replies), the client's gRPC takes only what the two sides' windows hold;
    once it reads, every call is answered and the stream goes on."""
    batch = pb.SessionBatch(
        calls=[call(i, "NoSuchMethod", b"x" * 512) for i in range(sessions.MAX_BATCH)]
    ).SerializeToString()
    offered = 400
    taken = queue.SimpleQueue()

    def batches() -> Iterator[bytes]:
        for n in range(offered):
            taken.put(n)
            yield batch
        time.sleep(60)  # keep the stream open while the replies are read

    channel = grpc.insecure_channel(server.address)
    stream = channel.stream_stream(SESSION)(batches(), timeout=60)
    try:
        time.sleep(3.0)  # replies unread: the server must stop taking calls
        assert taken.qsize() < offered / 4, f"{taken.qsize()} of {offered} batches were taken"
        answered = 0
        for raw in stream:
            answered += len(pb.SessionBatch.FromString(raw).calls)
            if answered >= offered * sessions.MAX_BATCH:
                break
        assert answered == offered * sessions.MAX_BATCH
    finally:
        stream.cancel()
        channel.close()


def test_a_session_holding_many_request_bytes_is_not_read_until_they_end(
    server, monkeypatch
) -> None:
    """Waiting reads padded with an unknown field hold their request bytes until they end;
    past MAX_HELD_BYTES the server takes no more calls of the session, so a contribution sent
    after them waits for them (instead of the server holding ever more bytes)."""
    monkeypatch.setattr(session_stream, "MAX_HELD_BYTES", 2**20)
    pad = codec.varint(1000 << 3 | 2) + codec.varint(300 * 2**10) + b"p" * (300 * 2**10)
    s = RawSession(server.address)
    try:
        s.opened()
        s.send(*[call(i, "ReadSlot", read(f"r:held{i}/0") + pad, 1.5) for i in range(4)])
        time.sleep(0.2)  # the reads are taken (and wait) before the next batch comes
        began = time.monotonic()
        s.send(call(9, "Contribute", contribution("r:after/0", np.ones(2, np.float32))))
        got: dict[int, pb.SessionCall] = {}
        while 9 not in got:
            got.update(s.replies(1))
        took = time.monotonic() - began
        got.update(s.replies(5 - len(got)) if len(got) < 5 else {})
        assert all(code_of(got[i]) == grpc.StatusCode.DEADLINE_EXCEEDED for i in range(4))
        assert got[9].code == 0
        assert took > 1.0, f"the contribution was taken after {took:.2f} s, with the reads held"
    finally:
        s.close()


def test_the_bytes_all_sessions_hold_are_bounded_per_server(server, monkeypatch) -> None:
    """A greedy session's waiting reads hold more request bytes than the server's bound for
    all sessions (SESSIONS_BYTES), each session well under its own bound. A session holding
    less than its share (the bound over the 3 sessions open) is still read at once: its read's
    contribution comes in its next batch. One holding more than its share gets its read taken,
    but the contribution after it waits until the greedy reads have ended. Nothing is counted
    once all have ended."""
    monkeypatch.setattr(session_stream, "SESSIONS_BYTES", 2**20)

    def padded(key: str, kib: int, timeout: float, i: int = 1) -> pb.SessionCall:
        pad = codec.varint(1000 << 3 | 2) + codec.varint(kib * 2**10) + b"p" * (kib * 2**10)
        return call(i, "ReadSlot", read(key) + pad, timeout)

    def contribution_to(key: str) -> pb.SessionCall:
        return call(2, "Contribute", contribution(key, np.ones(2, np.float32)))

    greedy, light, heavy = (RawSession(server.address) for _ in range(3))
    try:
        for s in (greedy, light, heavy):
            s.opened()
        share = session_stream.SESSIONS_BYTES // 3
        greedy.send(*[padded(f"r:g{i}/0", 300, 2.0, i) for i in range(5)])
        time.sleep(0.2)  # four are taken, past the bound and the share, the fifth waits
        held = server.sessions.held_bytes
        assert held >= session_stream.SESSIONS_BYTES
        took = {}
        for s, kib, key in ((light, 100, "r:light/0"), (heavy, 600, "r:heavy/0")):
            assert (kib * 2**10 < share) == (s is light)
            s.send(padded(key, kib, 10.0))
            time.sleep(0.2)
            assert server.sessions.held_bytes > held, "the read was not taken"
            held = server.sessions.held_bytes
            began = time.monotonic()
            s.send(contribution_to(key))
            got = s.replies(2)
            took[key] = time.monotonic() - began
            assert got[1].code == 0 and got[2].code == 0, got
        assert took["r:light/0"] < 0.5 and took["r:heavy/0"] > 1.0, took
        replies = greedy.replies(5)
        assert all(code_of(r) == grpc.StatusCode.DEADLINE_EXCEEDED for r in replies.values())
        deadline = time.monotonic() + 5
        while server.sessions.held_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.sessions.held_bytes == 0
    finally:
        for s in (greedy, light, heavy):
            s.close()


def test_calls_in_flight_are_bounded_per_session(server) -> None:
    """Waiting reads past MAX_WAITING are refused "retry later" at once, never the
    contribution that ends their wait; the bound frees as they end."""
    s = RawSession(server.address)
    try:
        s.opened()
        n = session_stream.MAX_WAITING
        s.send(*[call(i, "ReadSlot", read("r:wait/0", reader=i), 10) for i in range(n + 3)])
        early = s.replies(3)
        assert sorted(early) == [n, n + 1, n + 2]
        for reply in early.values():
            assert code_of(reply) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "retry later" in reply.details
        values = np.ones(2, np.float32)
        s.send(call(10_000, "Contribute", contribution("r:wait/0", values, readers=n)))
        got = s.replies(n + 1)
        assert all(r.code == 0 for r in got.values())
        s.send(call(10_001, "ReadSlot", read("r:late/0"), 0.2))  # room again
        assert code_of(s.replies(1)[10_001]) == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        s.close()


def settle(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_waiting_calls_in_sessions_pass_the_admission_gate() -> None:
    """Reads waiting in sessions take the gate's places (here 2: 4 workers, 2 reserved).
    Past them a read waits in line, holding no thread and getting no reply; a call that works
    still runs; once the slot is complete, the reads in threads answer and the one in line
    takes a freed place and answers too. Before the line, the third read was refused "retry
    later" and its client asked again after pauses of up to 1 s."""
    with ShardServer(local_calls=False, max_workers=4, reserved_workers=2) as server:
        s = RawSession(server.address)
        try:
            s.opened()
            s.send(*[call(i, "ReadSlot", read("r:gate/0", reader=i), 30) for i in range(3)])
            settle(lambda: len(server.sessions.line) == 1, "the third read to wait in line")
            assert server.gate.busy == 2  # the line holds no thread
            c = ShardClient(ClusterSpec([server.address]), timeout_s=5, sessions=False)
            try:
                assert c.status()[0]["address"] == server.address  # Status still runs
            finally:
                c.close()
            s.send(call(9, "Contribute", contribution("r:gate/0", np.ones(4, np.float32), 1, 3)))
            got = s.replies(4)
            assert {i: code_of(r) for i, r in got.items()} == dict.fromkeys(
                (0, 1, 2, 9), grpc.StatusCode.OK
            )
            for i in range(3):
                _, data = codec.decode(got[i].body, pb.SlotHeader)
                np.testing.assert_array_equal(np.frombuffer(data, np.float32), np.ones(4))
            assert server.sessions.line.admitted_later == 1 and len(server.sessions.line) == 0
            settle(lambda: server.gate.busy == 0, "every call to leave the gate")
        finally:
            s.close()


def test_a_call_whose_deadline_passes_in_line_is_answered_and_forgotten() -> None:
    """A read in line past its deadline gets DEADLINE_EXCEEDED from the server's sweep, and
    leaves nothing counted: the session's waiting calls and held bytes go back to zero."""
    # sweeps every 0.5 s: the read in line is answered 0.3-0.8 s after it came, long before
    # the slot, untouched for 2 s, is dropped with the two reads on it (with a TTL of 0.4 s,
    # its sweeps at 0.1 s, the two fell within one sweep of each other: 2 failures in 6 runs)
    limits = {"max_workers": 4, "reserved_workers": 2, "pending_ttl_s": 2.0}
    with ShardServer(local_calls=False, **limits) as server:
        s = RawSession(server.address)
        try:
            s.opened()
            s.send(*[call(i, "ReadSlot", read("r:late/0", reader=i), 30) for i in range(2)])
            settle(lambda: server.gate.busy == 2, "two reads to wait in threads")
            s.send(call(7, "ReadSlot", read("r:late/0", reader=2), 0.3))
            reply = s.replies(1)[7]
            assert code_of(reply) == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "waited for a thread" in reply.details and "--workers" in reply.details
            assert len(server.sessions.line) == 0 and server.gate.busy == 2
            s.send(call(9, "Contribute", contribution("r:late/0", np.ones(2, np.float32), 1, 2)))
            assert {code_of(r) for r in s.replies(3).values()} == {grpc.StatusCode.OK}
            settle(lambda: server.gate.busy == 0, "every call to leave the gate")
            # replies count until gRPC takes their batch, a moment after the client has them
            settle(lambda: server.sessions.held_bytes == 0, "the bytes counted to go back")
        finally:
            s.close()


def test_one_tokens_line_does_not_hold_back_anothers() -> None:
    """One token's reads past its bound (half of the waiting places) wait in line; another
    token's reads still find the places the first may not take, and answer first."""
    tokens = {"tok-a": "train", "tok-b": "train"}
    with ShardServer(local_calls=False, tokens=tokens, max_workers=6, reserved_workers=2) as server:
        greedy, other = RawSession(server.address, "tok-a"), None
        try:
            greedy.opened()
            greedy.send(*[call(i, "ReadSlot", read("r:a/0", reader=i), 30) for i in range(4)])
            settle(lambda: len(server.sessions.line) == 2, "two of its reads to wait in line")
            assert server.gate.busy == 2  # its bound: half of the 4 waiting places
            other = RawSession(server.address, "tok-b")
            other.opened()
            other.send(*[call(i, "ReadSlot", read("r:b/0", reader=i), 30) for i in range(2)])
            settle(lambda: server.gate.busy == 4, "the other token's reads to take places")
            other.send(call(9, "Contribute", contribution("r:b/0", np.ones(2, np.float32), 1, 2)))
            assert {code_of(r) for r in other.replies(3).values()} == {grpc.StatusCode.OK}
            assert len(server.sessions.line) == 2  # the greedy token's still wait for theirs
            greedy.send(call(9, "Contribute", contribution("r:a/0", np.ones(2, np.float32), 1, 4)))
            assert {code_of(r) for r in greedy.replies(5).values()} == {grpc.StatusCode.OK}
            assert server.sessions.line.admitted_later == 2
        finally:
            greedy.close()
            if other is not None:
                other.close()


def test_each_call_needs_its_methods_role() -> None:
    with ShardServer(tokens=TOKENS, local_calls=False) as server:
        anonymous = RawSession(server.address)
        with pytest.raises(grpc.RpcError) as err:
            anonymous.opened()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        anonymous.close()
        s = RawSession(server.address, "tok-read")
        try:
            s.opened()
            s.send(call(1, "Contribute", contribution("r:auth/0", np.ones(1, np.float32))))
            reply = s.replies(1)[1]
            assert code_of(reply) == grpc.StatusCode.PERMISSION_DENIED
            assert "role 'train'" in reply.details and "'read'" in reply.details
            s.send(call(2, "ReadSlot", read("r:auth/0"), timeout_s=0.2))
            assert code_of(s.replies(1)[2]) == grpc.StatusCode.PERMISSION_DENIED
        finally:
            s.close()
        trainer = RawSession(server.address, "tok-train")
        try:
            trainer.opened()
            trainer.send(call(1, "ReadSlot", read("r:auth/0"), timeout_s=0.2))
            reply = trainer.replies(1)[1]  # the refused contribution left nothing behind
            assert code_of(reply) == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            trainer.close()


def test_open_sessions_are_bounded_and_clients_past_it_call_one_by_one(caplog) -> None:
    """A client past the bound calls one by one, and says so once a process: the operator
    sizes --max-sessions."""
    with ShardServer(local_calls=False, max_sessions=1) as server:
        first = RawSession(server.address)
        first.opened()
        try:
            with caplog.at_level(logging.WARNING, logger="paramshard.client.session"):
                for run in ("a", "b"):  # a second client of the process: no second warning
                    c = ShardClient(ClusterSpec([server.address]), run_id=run, timeout_s=10)
                    try:
                        out = c.all_reduce(np.full(3, 2.0, np.float32))
                        assert out.tolist() == [2.0, 2.0, 2.0]
                        assert server.sessions.calls == 0  # its calls went one by one
                    finally:
                        c.close()
            said = [r.getMessage() for r in caplog.records if "refused a session" in r.getMessage()]
            assert len(said) == 1, said
            assert server.address in said[0] and "--max-sessions" in said[0], said
        finally:
            first.close()


def test_read_tokens_hold_at_most_a_quarter_of_the_sessions() -> None:
    """Read tokens cannot keep trainers out of sessions: with --max-sessions 4, one session
    of a read token is open at most, and trainers still get theirs."""
    with ShardServer(tokens=TOKENS, local_calls=False, max_sessions=4) as server:
        opened = []
        try:
            first = RawSession(server.address, "tok-read")
            opened.append(first)
            first.opened()
            second = RawSession(server.address, "tok-read")
            opened.append(second)
            with pytest.raises(grpc.RpcError) as err:
                second.opened()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "read tokens" in err.value.details()
            for _ in range(3):
                trainer = RawSession(server.address, "tok-train")
                opened.append(trainer)
                trainer.opened()
        finally:
            for s in opened:
                s.close()
