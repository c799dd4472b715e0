"""Shared memory between a client and a server on one host (server/transport/shm.py, protos/shm.py).

Real servers on 127.0.0.1 called through gRPC (``local_calls=False``, so the in-process fast
path does not hide the wire): payloads of pushes, sets, contributions and the replies of pulls
and slot reads travel in segments; the results are bitwise those of the in-band path
(``PARAMSHARD_SHM=0``). The registry refuses every reference that is not the caller's own,
confirmed segment, and nothing it refuses changes a slice.
"""

from __future__ import annotations

import gc
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import run_ranks

from paramshard.client import ClusterSpec, ShardClient, StepArgs
from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.transport import shm

N = 200_000  # 800 kB of float32: above SHM_MIN_BYTES, several chunks with chunk_bytes=256 KiB
CHUNK_BYTES = 256 * 2**10
TOKENS = {"tok-a": "train", "tok-b": "train"}


@pytest.fixture
def server() -> Iterator[ShardServer]:
    s = ShardServer(local_calls=False).start()
    yield s
    s.stop(0)


def client(address: str, token: str | None = None, **kw: Any) -> ShardClient:
    spec = ClusterSpec([address])
    if token:
        spec.token = token
    return ShardClient(spec, timeout_s=10, chunk_bytes=CHUNK_BYTES, **kw)


def train(c: ShardClient, job: str) -> dict[str, Any]:
    """Set, two pushes and steps, a pull, a slot all-reduce: what every strategy sends."""
    rng = np.random.default_rng(3)
    c.register_buffer(job, "w", N, optimizer="adam", hyper={"lr": 0.01})
    c.set_params(job, "w", rng.standard_normal(N).astype(np.float32))
    for step in range(2):
        grad = rng.standard_normal(N).astype(np.float32)
        c.push_grads(job, "w", grad, step, step_args=StepArgs(hyper={"lr": 0.01}))
    pulled = c.pull_params(job, "w", N, min_version=2)
    reduced = c.all_reduce(rng.standard_normal(N).astype(np.float32))
    return {"params": pulled, "all_reduce": reduced}


def test_payloads_travel_in_segments_and_equal_the_in_band_path(server, monkeypatch) -> None:
    c = client(server.address, run_id="shared")
    try:
        shared = train(c, "shared")
        assert c.shm.opened >= 1
        count, nbytes = server.servicer.segments.usage()
        assert count == c.shm.opened and nbytes >= count * CHUNK_BYTES
        assert server.servicer.budget.usage()["shm"] == nbytes  # paid from --max-memory
    finally:
        c.close()
    assert server.servicer.segments.usage() == (0, 0)  # close gives them back
    monkeypatch.setenv("PARAMSHARD_SHM", "0")
    c = client(server.address, run_id="in-band")
    try:
        in_band = train(c, "in-band")
        assert c.shm.opened == 0 and server.servicer.segments.usage() == (0, 0)
    finally:
        c.close()
    for key in shared:
        np.testing.assert_array_equal(shared[key], in_band[key])


def test_collectives_of_several_ranks_over_segments(server) -> None:
    def rank(c: ShardClient) -> Any:
        x = np.full(N, c.rank + 1.0, np.float32)
        return c.all_reduce(x), c.all_gather(x[: N // 4]), c.shm.opened

    results = run_ranks(rank, 3, [server.address], chunk_bytes=CHUNK_BYTES)
    for reduced, gathered, opened in results:
        np.testing.assert_array_equal(reduced, np.full(N, 6.0, np.float32))
        for r, part in enumerate(gathered):
            np.testing.assert_array_equal(part, np.full(N // 4, r + 1.0, np.float32))
        assert opened >= 1


def test_a_server_that_forgot_its_segments_is_sent_again(server) -> None:
    """A restarted server does not know the client's segments: FAILED_PRECONDITION, the pool
    is emptied, and the call goes again through new segments."""
    c = client(server.address)
    try:
        c.register_buffer("j", "w", N)
        c.set_params("j", "w", np.ones(N, np.float32))
        before = c.shm.opened
        server.servicer.segments.idle_s = 0.0
        assert server.servicer.segments.expire() >= 1  # as a restart would
        server.servicer.segments.idle_s = 600.0
        c.set_params("j", "w", np.full(N, 2.0, np.float32), version=0)
        np.testing.assert_array_equal(c.pull_params("j", "w", N), np.full(N, 2.0, np.float32))
        assert c.shm.opened > before
    finally:
        c.close()


# -- what the registry refuses --------------------------------------------------------------
def raw(address: str, method: str, request: Any, token: str) -> tuple[grpc.StatusCode, str, Any]:
    with grpc.insecure_channel(address) as chan:
        stub = chan.unary_unary(
            f"/paramshard.v1.Shard/{method}",
            request_serializer=codec.serialize,
            response_deserializer=lambda b: b,
        )
        try:
            reply = stub(request, timeout=10, metadata=(("authorization", f"Bearer {token}"),))
            return grpc.StatusCode.OK, "", reply
        except grpc.RpcError as exc:
            return exc.code(), exc.details(), None


def open_segment(address: str, token: str, proof: bytes | None = None) -> tuple[int, Any]:
    """The handshake by hand: (segment id, mapping); ``proof`` replaces the true one."""
    code, details, reply = raw(address, "OfferSegment", pb.OfferSegmentRequest(nbytes=2**20), token)
    assert code == grpc.StatusCode.OK, details
    offer = pb.OfferSegmentReply.FromString(reply)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect("\0" + offer.socket[1:])
        sock.sendall(offer.ticket)
        msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
    assert msg == b"ok" and len(fds) == 1
    import mmap
    import os

    mapped = mmap.mmap(fds[0], offer.nbytes)
    os.close(fds[0])
    proof = proof or mapped[: shm.PROOF_BYTES]
    confirm = pb.ConfirmSegmentRequest(segment=offer.segment, proof=proof)
    code, details, _ = raw(address, "ConfirmSegment", confirm, token)
    if proof == mapped[: shm.PROOF_BYTES]:
        assert code == grpc.StatusCode.OK, details
    else:
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "proof" in details, details
    return offer.segment, mapped


@pytest.fixture
def guarded() -> Iterator[tuple[ShardServer, np.ndarray]]:
    """A server with two train tokens and job 'g' (buffer 'w' of 64 Ki elements) set by tok-a."""
    s = ShardServer(local_calls=False, tokens=TOKENS).start()
    c = client(s.address, "tok-a")
    values = np.arange(2**16, dtype=np.float32)
    c.register_buffer("g", "w", values.size, hyper={"lr": 0.5})
    c.set_params("g", "w", values)
    c.close()
    yield s, values
    s.stop(0)


def push(segment: int, nbytes: int, offset: int = 0, data: bytes = b"") -> tuple:
    header = pb.PushGradHeader(
        ref=pb.BufferRef(job="g", buffer="w"),
        chunk=pb.Chunk(offset=0, numel=2**16, dtype=pb.FLOAT32),
        step=0,
        num_micro=1,
        shm=pb.ShmRef(segment=segment, offset=offset, nbytes=nbytes),
    )
    return header, data


@pytest.mark.parametrize(
    "case, code, words",
    [
        ("another caller's", grpc.StatusCode.FAILED_PRECONDITION, "unknown here"),
        ("unknown", grpc.StatusCode.FAILED_PRECONDITION, "unknown here"),
        ("unconfirmed", grpc.StatusCode.FAILED_PRECONDITION, "unknown here"),
        ("out of range", grpc.StatusCode.INVALID_ARGUMENT, "outside"),
        ("also in-band", grpc.StatusCode.INVALID_ARGUMENT, "both"),
    ],
)
def test_references_the_registry_refuses_change_nothing(guarded, case, code, words) -> None:
    s, values = guarded
    segment, mapped = open_segment(s.address, "tok-a")
    mapped[: 2**18] = np.ones(2**16, np.float32).tobytes()
    token, nbytes, offset, data, used = "tok-a", 2**18, 0, b"", segment
    if case == "another caller's":
        token = "tok-b"
    elif case == "unknown":
        used = segment ^ 1
    elif case == "unconfirmed":
        segment, _ = open_segment(s.address, "tok-a", proof=b"\0" * shm.PROOF_BYTES)
        used = segment
    elif case == "out of range":
        offset = 2**20 - 2**17
    elif case == "also in-band":
        data = b"\0" * 4
    got, details, _ = raw(s.address, "PushGrad", push(used, nbytes, offset, data), token)
    assert got == code and words in details, (got, details)
    c = client(s.address, "tok-a")
    try:
        np.testing.assert_array_equal(c.pull_params("g", "w", values.size), values)
        (row,) = c.status()
        assert int(row["jobs"][0]["buffers"][0]["version"]) == 0
    finally:
        c.close()
    # the owner's own reference goes through, and counts for the first time
    got, details, reply = raw(s.address, "PushGrad", push(segment, nbytes), "tok-a")
    if case == "unconfirmed":
        assert got == grpc.StatusCode.FAILED_PRECONDITION, details
    else:
        assert got == grpc.StatusCode.OK, details
        assert not pb.PushGradReply.FromString(reply).duplicate


def test_offers_are_bounded(guarded, monkeypatch) -> None:
    s, _ = guarded
    for nbytes in (0, shm.MAX_SEGMENT_BYTES + 1):
        request = pb.OfferSegmentRequest(nbytes=nbytes)
        code, details, _ = raw(s.address, "OfferSegment", request, "tok-a")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in details, details
    monkeypatch.setattr(shm, "MAX_SEGMENTS", 2)
    for _ in range(2):
        open_segment(s.address, "tok-a")
    code, details, _ = raw(s.address, "OfferSegment", pb.OfferSegmentRequest(nbytes=2**20), "tok-a")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "ReleaseSegments" in details, details
    # per caller: the other token still gets one
    open_segment(s.address, "tok-b")


def test_a_ticket_opens_one_segment_once(guarded) -> None:
    s, _ = guarded
    code, _, reply = raw(s.address, "OfferSegment", pb.OfferSegmentRequest(nbytes=2**20), "tok-a")
    offer = pb.OfferSegmentReply.FromString(reply)
    answers = []
    for ticket in (b"x" * len(offer.ticket), offer.ticket, offer.ticket):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect("\0" + offer.socket[1:])
            sock.sendall(ticket)
            msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
            for fd in fds:
                __import__("os").close(fd)
            answers.append((msg, len(fds)))
    assert answers == [(b"no", 0), (b"ok", 1), (b"no", 0)]


def test_unconfirmed_offers_expire(guarded, monkeypatch) -> None:
    s, _ = guarded
    raw(s.address, "OfferSegment", pb.OfferSegmentRequest(nbytes=2**20), "tok-a")
    assert s.servicer.segments.usage()[0] == 1
    monkeypatch.setattr(shm, "CONFIRM_S", 0.0)
    assert s.servicer.segments.expire() == 1
    assert s.servicer.segments.usage() == (0, 0) and s.servicer.budget.usage()["shm"] == 0


@pytest.mark.parametrize(("env", "argument", "shares"), [("1", False, False), ("0", True, True)])
def test_the_client_argument_overrides_the_environment(
    server, monkeypatch, env: str, argument: bool, shares: bool
) -> None:
    monkeypatch.setenv("PARAMSHARD_SHM", env)
    c = client(server.address, shared_memory=argument)
    try:
        c.register_buffer("j", "w", N)
        c.set_params("j", "w", np.ones(N, np.float32))
        assert (c.shm.opened > 0) == shares
        assert (server.servicer.segments.views > 0) == shares
    finally:
        c.close()


def test_a_client_refused_more_segments_sends_the_rest_in_band(server, monkeypatch) -> None:
    monkeypatch.setattr(shm, "MAX_SEGMENTS", 1)
    c = client(server.address)
    try:
        c.register_buffer("j", "w", N)
        values = np.arange(N, dtype=np.float32)
        c.set_params("j", "w", values)  # 4 chunks in flight at once: 1 segment, the rest in-band
        np.testing.assert_array_equal(c.pull_params("j", "w", N), values)
        assert c.shm.opened == 1 and server.servicer.segments.usage()[0] == 1
    finally:
        c.close()


def test_views_on_some_servers_share_the_segments_by_address(servers) -> None:
    """A view (``on_servers``, a group) numbers the servers its own way: its server 0 is the
    parent's server 1. Segments are pooled by address, so neither sends the other's."""
    s0, s1 = servers(2, local_calls=False)
    c = ShardClient(ClusterSpec([s0.address, s1.address]), timeout_s=10, chunk_bytes=CHUNK_BYTES)
    view = c.on_servers([1])
    try:
        for client_, server, job in ((view, s1, "v"), (c, s0, "c"), (view, s1, "v2")):
            client_.register_buffer(job, "w", N)
            values = np.full(N, float(len(job)), np.float32)
            client_.set_params(job, "w", values)
            np.testing.assert_array_equal(client_.pull_params(job, "w", N), values)
            assert server.servicer.segments.usage()[0] >= 1
    finally:
        c.close()


def test_a_slot_read_into_a_forgotten_segment_loses_nothing(server) -> None:
    """A slot read frees what it read: a reply segment the server no longer knows must be
    refused before the read, so the call sent again still finds the chunk (CI: recovery
    after a server kill read 'was read by all its readers and freed')."""
    c = client(server.address)
    try:
        x = np.arange(N, dtype=np.float32)
        np.testing.assert_array_equal(c.all_reduce(x), x)  # the pool holds reply segments now
        server.servicer.segments.idle_s = 0.0
        assert server.servicer.segments.expire() >= 1  # as a restart would
        server.servicer.segments.idle_s = 600.0
        np.testing.assert_array_equal(c.all_reduce(x + 1), x + 1)
    finally:
        c.close()


def test_a_released_segment_a_pull_waits_to_write_into_stays_paid_for(guarded) -> None:
    """A pull for a version not reached yet holds a view of the segment its reply goes to. The
    caller releasing that segment meanwhile no longer gives its memory back to the budget at
    once (its pages stay mapped for the pull): it is unmapped and refunded once the pull has
    ended and the sweeper looks (``expire``)."""
    s, _ = guarded
    segments, budget = s.servicer.segments, s.servicer.budget
    s.servicer.max_wait_s = 3.0  # the pull gives up after 3 s
    segment, mapped = open_segment(s.address, "tok-a")
    assert budget.usage()["shm"] == 2**20
    pull = pb.PullParamsRequest(
        ref=pb.BufferRef(job="g", buffer="w"),
        min_version=1,  # never reached: nobody pushes
        chunk=pb.Chunk(offset=0, numel=2**16, dtype=pb.FLOAT32),
        reply_shm=pb.ShmRef(segment=segment, offset=0, nbytes=2**18),
    )
    ended: list[Any] = []
    waiting = threading.Thread(
        target=lambda: ended.append(raw(s.address, "PullParams", pull, "tok-a")[0])
    )
    views = segments.views  # the fixture's calls may have used segments already
    waiting.start()
    try:
        for _ in range(200):  # the pull took its view of the segment
            if segments.views > views:
                break
            time.sleep(0.02)
        assert segments.views > views, "the pull never took its view of the segment"
        time.sleep(0.3)  # and waits with it
        release = pb.ReleaseSegmentsRequest(segments=[segment])
        assert raw(s.address, "ReleaseSegments", release, "tok-a")[0] == grpc.StatusCode.OK
        assert segments.usage() == (0, 0)  # not listed: no call can name it any more
        assert budget.usage()["shm"] == 2**20, "refunded while the pull still holds its pages"
        segments.expire()
        assert budget.usage()["shm"] == 2**20
    finally:
        waiting.join(30)
    assert ended == [grpc.StatusCode.DEADLINE_EXCEEDED], ended
    for _ in range(100):  # the handler's frames let go of the view (a traceback may hold it
        segments.expire()  # until the collector runs)
        if budget.usage()["shm"] == 0:
            break
        gc.collect()
        time.sleep(0.05)
    assert budget.usage()["shm"] == 0, "still paid for after the pull ended"
    mapped.close()


def test_clients_sharing_a_spec_close_one_by_one(server: ShardServer) -> None:
    """Ranks of one process may share a ClusterSpec (tests and benchmarks do). One closing its
    client must not close the channels under the other's calls; the last one closes them, and
    each close releases its own segments without raising. Before ``ClusterSpec.hold``, the
    first close closed the shared channels: the second rank's next call and its close (the
    release of its segments) failed with "Cannot invoke RPC on closed channel"."""
    spec = ClusterSpec([server.address])
    clients = [
        ShardClient(spec, rank=r, world_size=2, timeout_s=10, chunk_bytes=CHUNK_BYTES)
        for r in range(2)
    ]
    x = np.arange(N, dtype=np.float32)
    try:
        with ThreadPoolExecutor(2) as pool:
            sums = list(pool.map(lambda c: c.all_reduce(x), clients, timeout=60))
        assert all(np.array_equal(s, 2 * x) for s in sums)
        assert all(c.shm.opened for c in clients)  # the payloads went through segments
        assert all(c.status()[0].get("error") is None for c in clients)  # stubs on the channel
        clients[0].close()
        assert clients[1].status()[0].get("error") is None  # its channel is still open
        assert spec._channels.by_address  # noqa: SLF001 - held by the open client
    finally:
        for c in clients:
            c.close()
    assert not spec._channels.by_address  # noqa: SLF001 - the last close closed them
