"""Hostile slot, session, segment and mailbox helpers (tests/test_hostile_slots.py): two teams'
scoped tokens beside the unscoped ones, slot headers and raw calls by hand, a raw Session
stream that sends any bytes, and timing of other callers' calls while a hostile one runs."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import numpy as np
from replica_probes import TOKENS
from test_hardening_replication import client_for

from paramshard.protos import shard_pb2 as pb
from paramshard.protos.batches import decode_batch, encode_batch
from paramshard.server import ShardServer
from paramshard.server.servicer import SERVICE_NAME

Code = grpc.StatusCode
TEAM_TOKENS = {
    **TOKENS,
    "a": "train jobs=team-a-*",
    "b": "train jobs=team-b-*",
    "a-read": "read jobs=team-a-*",
    "a-admin": "admin jobs=team-a-*",
}
BAD = (Code.INTERNAL, Code.UNKNOWN)
PULL_B = pb.PullParamsRequest(
    ref=pb.BufferRef(job="team-b-j", buffer="w"),
    chunk=pb.Chunk(offset=0, numel=4, dtype=pb.FLOAT32),
)
"""Team B's pull of its own 16-byte slice (``team_b_job``)."""


def team_server(servers: Any, **kw: Any) -> ShardServer:
    """One server with both teams' tokens, every call over gRPC."""
    (node,) = servers(1, tokens=TEAM_TOKENS, local_calls=False, **kw)
    return node


def team_b_job(address: str) -> None:
    """Team B's job 'team-b-j': one buffer 'w' of 4 elements, initialised."""
    c = client_for([address], token="b")
    try:
        c.register_buffer("team-b-j", "w", 4, optimizer="sgd", hyper={"lr": 0.1})
        c.set_params("team-b-j", "w", np.arange(4, dtype=np.float32))
    finally:
        c.close()


def header(
    key: str,
    contributor: int = 0,
    expected: int = 1,
    op: int = pb.SET,
    numel: int = 4,
    readers: int = 1,
    **kw: Any,
) -> pb.SlotHeader:
    """A one-chunk slot's header (``kw``: any other SlotHeader field, ``chunk`` included)."""
    kw.setdefault("chunk", pb.Chunk(offset=0, numel=numel, dtype=pb.FLOAT32))
    kw.setdefault("total_numel", numel)
    kw.setdefault("chunk_numel", numel)
    return pb.SlotHeader(
        key=key, op=op, expected=expected, readers=readers, contributor=contributor, **kw
    )


def contribution(h: pb.SlotHeader, values: Any = None) -> pb.ContributeRequest:
    """A ContributeRequest of ``h`` carrying ``values`` (float32; default: the chunk's ones)."""
    if values is None:
        values = np.ones(h.chunk.numel, np.float32)
    return pb.ContributeRequest(header=h, data=np.asarray(values, np.float32).tobytes())


def read(key: str, reader: int = 0, offset: int = 0, **kw: Any) -> pb.ReadSlotRequest:
    return pb.ReadSlotRequest(key=key, offset=offset, reader=reader, **kw)


def values(reply: Any) -> list[float]:
    assert isinstance(reply, pb.ReadSlotReply), reply.details()
    return np.frombuffer(reply.data, np.float32).tolist()


def timed_call(
    address: str, method: str, req: Any, token: str | None, timeout: float = 30
) -> tuple[Any, float]:
    """``call`` with a deadline of ``timeout`` seconds: (its reply or error, seconds taken)."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    methods = pb.DESCRIPTOR.services_by_name["Shard"].methods_by_name
    reply = getattr(pb, methods[method].output_type.name)
    began = time.monotonic()
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as ch:
        stub = ch.unary_unary(
            f"/{SERVICE_NAME}/{method}",
            request_serializer=lambda r: r if isinstance(r, bytes) else r.SerializeToString(),
            response_deserializer=reply.FromString,
        )
        try:
            out = stub(req, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            assert exc.code() not in BAD, f"{method}: {exc.details()}"
            out = exc
    return out, time.monotonic() - began


class Background:
    """``fn()`` on a thread of its own: ``result()`` waits for what it returned."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._out: list[Any] = []
        self._thread = threading.Thread(target=lambda: self._out.append(fn()), daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def result(self, timeout: float = 60) -> Any:
        self._thread.join(timeout)
        assert self._out, "the call did not return"
        return self._out[0]


def worst_latency(address: str, busy: Background, token: str = "reader-secret") -> float:
    """The slowest of the Status calls made one after another while ``busy`` runs (at most
    60 s): what another caller waited meanwhile."""
    worst, end = 0.0, time.monotonic() + 60
    while busy.alive() and time.monotonic() < end:
        out, took = timed_call(address, "Status", pb.StatusRequest(), token)
        assert isinstance(out, pb.StatusReply), out.details()
        worst = max(worst, took)
        time.sleep(0.05)
    return worst


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def packed_ids(count: int) -> bytes:
    """A ReleaseSegmentsRequest naming segment 1 ``count`` times, packed: one byte an id."""
    return b"\x0a" + varint(count) + b"\x01" * count


def raw_call(inner: bytes) -> bytes:
    """A SessionBatch holding one SessionCall of the bytes ``inner``."""
    return b"\x0a" + varint(len(inner)) + inner


def session_call(call_id: int, method: str, body: Any, timeout_s: float = 10) -> tuple:
    return pb.SessionCall(id=call_id, method=method, timeout_s=timeout_s), body


class RawSession:
    """A Session stream that sends whatever bytes it is given (``send``: calls; ``send_raw``:
    a batch's bytes) and keeps each reply (call, body bytes); ``error``: how the stream
    ended, once it did. Closed (cancelled) by ``close`` or on leaving a ``with``."""

    def __init__(self, address: str, token: str | None, timeout: float = 60) -> None:
        self.channel = grpc.insecure_channel(address)
        self._out: queue.Queue[Any] = queue.Queue()
        self.replies: queue.Queue[Any] = queue.Queue()
        self.error: grpc.RpcError | None = None
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        stub = self.channel.stream_stream(
            f"/{SERVICE_NAME}/Session",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        self.stream = stub(self._requests(), metadata=metadata, timeout=timeout)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self) -> Any:
        while (item := self._out.get()) is not None:
            yield item

    def _read(self) -> None:
        try:
            for raw in self.stream:
                for head, body in decode_batch(raw):
                    self.replies.put((head, bytes(body)))
        except grpc.RpcError as exc:
            self.error = exc
        self.replies.put(None)

    def send(self, calls: list[tuple]) -> None:
        self._out.put(encode_batch(calls))

    def send_raw(self, raw: bytes) -> None:
        self._out.put(raw)

    def take(self, n: int, timeout: float = 10) -> list[tuple[pb.SessionCall, bytes]]:
        """Up to ``n`` replies, within ``timeout`` seconds or until the stream ends."""
        got, end = [], time.monotonic() + timeout
        while len(got) < n:
            try:
                item = self.replies.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                self.replies.put(None)
                break
            got.append(item)
        return got

    def ended(self, timeout: float = 10) -> grpc.RpcError | None:
        self._reader.join(timeout)
        return self.error

    def close(self) -> None:
        self._out.put(None)
        self.stream.cancel()
        self._reader.join(10)
        self.channel.close()

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def slot_keys(server: ShardServer) -> list[str]:
    return sorted(s.key for s in server.servicer.slots.open_slots())


def settled(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether ``check()`` holds within ``timeout`` seconds (asked every 0.1 s)."""
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def churn_freed_keys(address: str, token: str, run: str, pairs: int = 20_400) -> None:
    """``pairs`` SET messages of ~1 KB keys of ``run``, each sent and read (so freed), through
    one session, 60 pairs a batch (its 64 waiting reads' bound)."""
    one, pad, n = np.ones(1, np.float32), "x" * 980, 0
    with RawSession(address, token) as s:
        while n < pairs:
            calls = []
            for i in range(60):
                k, n = f"{run}:{pad}{n}", n + 1
                calls.append(session_call(2 * i + 1, "Contribute", (header(k, numel=1), one)))
                calls.append(session_call(2 * i + 2, "ReadSlot", read(k).SerializeToString()))
            s.send(calls)
            got = s.take(120, 30)
            assert len(got) == 120 and not any(c.code for c, _ in got), got[:2]


def cancelled_reads(address: str, token: str, keys: list[str]) -> None:
    """A ReadSlot of each of ``keys`` with a long deadline, cancelled 50 ms after it went."""
    for key in keys:
        with grpc.insecure_channel(address) as chan:
            stub = chan.unary_unary(
                f"/{SERVICE_NAME}/ReadSlot",
                request_serializer=pb.ReadSlotRequest.SerializeToString,
                response_deserializer=pb.ReadSlotReply.FromString,
            )
            metadata = (("authorization", f"Bearer {token}"),)
            pending = stub.future(read(key), timeout=60, metadata=metadata)
            time.sleep(0.05)
            pending.cancel()


def freed_chunk_growth(chunks: int) -> tuple[int, int]:
    """(bytes traced, bytes charged) after ``chunks`` one-element chunks of one slot of 2**62
    chunks were each contributed and read (freed), on a SlotStore of its own."""
    import tracemalloc

    from paramshard.server.collectives.slots import SlotStore

    store = SlotStore()
    one = memoryview(np.ones(1, np.float32).tobytes())
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for k in range(chunks):
            chunk = pb.Chunk(offset=k, numel=1, dtype=pb.FLOAT32)
            store.contribute(header("r:x", total_numel=2**62, chunk_numel=1, chunk=chunk), one)
            store.read(read("r:x", offset=k), 1.0)
        return tracemalloc.get_traced_memory()[0] - base, store.memory.held
    finally:
        tracemalloc.stop()


@contextmanager
def waiting_contribute_reads(address: str, token: str, count: int, nbytes: int) -> Iterator[None]:
    """``count`` ContributeReads of ``token`` waiting (5 s) for a second contributor that never
    comes, each's payload of ``nbytes`` in a segment of its own (pages never touched)."""
    from shm_probes import Segment

    waiting, segments = [], []
    try:
        for i in range(count):
            segments.append(seg := Segment(address, token, nbytes))
            h = header(f"team-a-r:ar{i}/0", expected=2, readers=2, op=pb.SUM,
                        numel=nbytes // 4, shm=seg.ref(nbytes))  # fmt: skip
            req = pb.ContributeRequest(header=h)
            waiting.append(
                Background(lambda r=req: timed_call(address, "ContributeRead", r, token, 5))
            )
            time.sleep(0.3)
        yield
    finally:
        for w in waiting:
            w.result()
        for seg in segments:
            seg.close()
