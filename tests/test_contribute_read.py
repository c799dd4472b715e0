"""ContributeRead (server/collectives/contribute_read.py): a contribution and the read of its
chunk's result in one call, the call every all-reduce chunk makes. The collectives tests run
it over every transport already (conftest.py's matrix); here what is its own: the contribution
held in place and never written, the copy when the call ends early, the waits it takes on the
server's gate (and that its contribution goes in even when its wait is refused), and the
requests it refuses. Real servers on 127.0.0.1 through gRPC, and the SlotStore itself."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.client.retries import freed_slot
from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.collectives.contribute_read import contribute_read
from paramshard.server.collectives.slots import SlotStore
from paramshard.server.runtime.errors import ShardError

N = 6


def header(key: str, contributor: int, expected: int = 2, op: int = pb.SUM) -> pb.SlotHeader:
    return pb.SlotHeader(
        key=key,
        op=op,
        expected=expected,
        readers=expected,
        total_numel=N,
        chunk_numel=N,
        contributor=contributor,
        chunk=pb.Chunk(offset=0, numel=N, dtype=pb.FLOAT64),
    )


def view(values: np.ndarray) -> memoryview:
    """A payload as the server gets one: bytes, here a view of ``values``' own memory."""
    return memoryview(values).cast("B")


def in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def wait_for(cond: Any, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def chunk_of(store: SlotStore, key: str) -> Any:
    """Chunk 0 of slot ``key``, None while it has none."""
    slots = [s for s in store.open_slots() if s.key == key]
    return slots[0].chunks.get(0) if slots else None


def test_the_first_contribution_stays_in_place_unwritten_and_every_reader_gets_the_sum() -> None:
    store = SlotStore()
    a, b = np.arange(N, dtype=np.float64), np.full(N, 0.5)
    a_before = a.copy()
    first, got = in_thread(lambda: contribute_read(store, header("k", 0), view(a), 10.0))
    wait_for(lambda: chunk_of(store, "k") is not None and chunk_of(store, "k").held_by == 0)
    assert np.shares_memory(chunk_of(store, "k").acc, a)  # held: not copied
    second = contribute_read(store, header("k", 1), view(b), 10.0)
    first.join(10)
    for h, payload in (got[0], second):
        assert h.chunk.numel == N
        np.testing.assert_array_equal(np.frombuffer(payload, np.float64), a_before + b)
    np.testing.assert_array_equal(a, a_before)  # the caller's memory was never written
    assert store.usage() == (0, 0)  # read by both: freed, its memory given back


def test_a_call_that_ends_before_the_next_contribution_leaves_a_copy() -> None:
    """A held contribution whose call times out is copied out first: the caller may write its
    memory again, and the chunk still adds the values it sent."""
    store = SlotStore()
    a, b = np.arange(N, dtype=np.float64), np.ones(N)
    with pytest.raises(ShardError) as err:
        contribute_read(store, header("t", 0), view(a), 0.2)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    chunk = chunk_of(store, "t")
    assert chunk.held_by is None and not np.shares_memory(chunk.acc, a)
    sent = a.copy()
    a[:] = -7.0  # the caller's next use of its memory
    store.contribute(header("t", 1), view(b))
    h, payload = store.read(pb.ReadSlotRequest(key="t", offset=0, reader=1), 5.0)
    np.testing.assert_array_equal(np.frombuffer(payload, np.float64), sent + b)


@pytest.mark.parametrize("op", [pb.SUM, pb.MEAN, pb.MAX, pb.MIN])
def test_three_contributors_in_rank_order_give_the_contributes_bits(op: int) -> None:
    """Held or copied, the same additions of the same operands in the same order: bit for bit
    what Contribute and ReadSlot give, whatever order the contributions arrive in."""
    rng = np.random.default_rng(3)
    values = [rng.standard_normal(N) * 10.0**k for k in range(3)]
    plain = SlotStore()
    for c in (2, 0, 1):
        plain.contribute(header("p", c, 3, op), view(values[c]), 5.0)
    _, want = plain.read(pb.ReadSlotRequest(key="p", offset=0, reader=0), 5.0)
    fused = SlotStore()
    calls = [
        in_thread(lambda c=c: contribute_read(fused, header("f", c, 3, op), view(values[c]), 10.0))
        for c in (2, 0, 1)
    ]
    for t, out in calls:
        t.join(10)
        _, payload = out[0]
        assert bytes(payload) == bytes(want)


def test_a_set_slot_is_refused_and_nothing_is_kept() -> None:
    store = SlotStore()
    h = header("s", 0, expected=1, op=pb.SET)
    with pytest.raises(ShardError) as err:
        contribute_read(store, h, memoryview(np.ones(N)), 1.0)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "SET" in err.value.message
    assert store.usage() == (0, 0)


def raw_call(address: str, h: pb.SlotHeader, values: np.ndarray, timeout: float = 10) -> Any:
    with grpc.insecure_channel(address) as chan:
        stub = chan.unary_unary(
            "/paramshard.v1.Shard/ContributeRead",
            request_serializer=codec.serialize,
            response_deserializer=codec.deserializer(pb.SlotHeader),
        )
        return stub((h, values), timeout=timeout)


def test_a_refused_wait_still_adds_its_contribution_and_a_retry_reads_the_result() -> None:
    """A server whose waiting calls may take one thread: a second call that would wait is
    refused "retry later", but its contribution is in, so the chunk completes once the other
    rank's arrives, and the retry (a duplicate contribution) reads the result at once."""
    server = ShardServer(
        "127.0.0.1", 0, max_workers=2, reserved_workers=1, local_calls=False
    ).start()
    try:
        x0, y0, x1, y1 = (np.full(N, v) for v in (1.0, 2.0, 10.0, 20.0))
        waiting, first = in_thread(lambda: raw_call(server.address, header("x", 0), x0))
        wait_for(lambda: server.gate.waiting["train"] == 1)
        with pytest.raises(grpc.RpcError) as err:
            raw_call(server.address, header("y", 0), y0)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry later" in err.value.details() and "contribution is in" in err.value.details()
        chunk = chunk_of(server.servicer.slots, "y")
        assert chunk.contributors == {0} and chunk.held_by is None  # in, and copied out
        # rank 1's contributions complete both chunks (each completes at once: no wait)
        for key, values, want in (("x", x1, x0 + x1), ("y", y1, y0 + y1)):
            _, payload = raw_call(server.address, header(key, 1), values)
            np.testing.assert_array_equal(np.frombuffer(payload, np.float64), want)
        waiting.join(10)
        np.testing.assert_array_equal(np.frombuffer(first[0][1], np.float64), x0 + x1)
        _, again = raw_call(server.address, header("y", 0), y0)  # the retry
        np.testing.assert_array_equal(np.frombuffer(again, np.float64), y0 + y1)
        assert server.gate.waiting["train"] == 0 and server.gate.busy == 0
    finally:
        server.stop(0)


def test_an_all_reduce_makes_one_call_a_chunk() -> None:
    """Two ranks over two servers through gRPC: every chunk is one ContributeRead, no
    Contribute or ReadSlot, and the sum is the contributor-order sum."""
    servers = [ShardServer("127.0.0.1", 0, local_calls=False).start() for _ in range(2)]
    spec = [s.address for s in servers]
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(300_000) for _ in range(2)]
    try:
        clients = [
            ShardClient(ClusterSpec(spec), rank=r, world_size=2, run_id="cr", chunk_bytes=2**18)
            for r in range(2)
        ]
        sent: list[str] = []
        for c in clients:
            send = c._send

            def counted(call: Any, *a: Any, send: Any = send, **kw: Any) -> Any:
                sent.append(call.method)
                return send(call, *a, **kw)

            c._send = counted  # type: ignore[method-assign]
        threads = [in_thread(lambda r=r: clients[r].all_reduce(xs[r])) for r in range(2)]
        for t, _ in threads:
            t.join(60)
        for _, out in threads:
            np.testing.assert_array_equal(out[0], xs[0] + xs[1])
        chunks = -(-300_000 * 8 // 2 // 2**18)  # each server's half, in chunks
        assert set(sent) == {"ContributeRead"} and len(sent) == 2 * 2 * chunks, sent
        for c in clients:
            c.close()
    finally:
        for s in servers:
            s.stop(0)


def test_a_reply_lost_after_the_read_counted_says_the_result_is_gone() -> None:
    """The server answers rank 0's ContributeRead, but the reply does not arrive (here: the
    handler fails UNAVAILABLE after the real call, as a connection that breaks then). Rank 1
    reads too, so the chunk is freed, and rank 0's retry finds it gone: the error says why,
    instead of only that the slot was freed."""
    server = ShardServer("127.0.0.1", 0, local_calls=False).start()
    segments = server.servicer.segments
    real, lost = segments.reply, []

    rank1_read = threading.Event()

    def reply_lost(req: Any, *args: Any) -> Any:  # the read is counted by now
        got = real(req, *args)
        if isinstance(req, pb.SlotHeader) and req.contributor == 0 and not lost:
            lost.append(req.key)
            assert rank1_read.wait(30)  # so the retry finds the chunk freed, however slow
            raise ShardError(grpc.StatusCode.UNAVAILABLE, "the connection broke (made by the test)")
        return got

    segments.reply = reply_lost
    clients = [
        ShardClient(ClusterSpec([server.address]), rank=r, world_size=2, run_id="lost")
        for r in range(2)
    ]
    try:
        xs = [np.full(N, float(r + 1)) for r in range(2)]

        def rank(r: int) -> np.ndarray:
            try:
                return clients[r].all_reduce(xs[r])
            finally:
                if r == 1:
                    rank1_read.set()

        done = [in_thread(lambda r=r: rank(r)) for r in range(2)]
        for t, _ in done:
            t.join(60)
        np.testing.assert_array_equal(done[1][1][0], xs[0] + xs[1])  # rank 1 got its result
        err = done[0][1][0]
        assert lost and isinstance(err, ShardClientError), err
        assert err.code == grpc.StatusCode.NOT_FOUND and "freed" in err.details
        assert "lost its reply" in err.details and "(after 2 attempts" in err.details
    finally:
        for c in clients:
            c.close()
        server.stop(0)


def test_a_chunk_freed_while_its_slot_is_open_is_named_freed_too() -> None:
    """A retried read of one chunk that every reader has read, while the slot's other chunks
    are still open: the server's NOT_FOUND says "freed" as for a whole slot, so the client's
    ``freed_slot`` explains it the same way."""
    store = SlotStore()
    h = header("two", 0, expected=1)
    h.total_numel, h.chunk_numel = 2 * N, N
    store.contribute(h, view(np.ones(N)), 1.0)  # chunk 0 of 2; chunk 1 never comes
    req = pb.ReadSlotRequest(key="two", offset=0, reader=0)
    store.read(req, 1.0)
    with pytest.raises(ShardError) as err:
        store.read(req, 1.0)
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "chunk at 0" in err.value.message
    assert freed_slot("ReadSlot", err.value.code, err.value.message, 2)
