"""Shared memory that no caller can turn against the server or another caller (issue 27,
findings 1-4; server/transport/shm.py, server/transport/handover.py, protos/shm.py).

Each probe runs against a real server: a ``paramshard serve`` subprocess where the failure
was a crash (a SIGBUS ends the whole process), an in-process one otherwise, and checks what
the other callers still have.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from shm_probes import Segment, claim, offer, raw
from test_cli import ServeProcess

from paramshard.client import ClusterSpec, ShardClient
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.shm import SEALS, is_sealed

TOKENS = {"tok-read": "read", "tok-read2": "read", "tok-train": "train", "tok-other": "train"}
N = 2**16  # float32 elements of the job's buffer: 256 KiB
REF = pb.BufferRef(job="g", buffer="w")


def client(address: str, token: str | None, **kw) -> ShardClient:
    spec = ClusterSpec([address])
    spec.token = token
    return ShardClient(spec, timeout_s=10, chunk_bytes=256 * 2**10, **kw)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ServeProcess, str, np.ndarray]]:
    """``paramshard serve`` with read and train tokens, job 'g' set by tok-train."""
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{role} {token}\n" for token, role in TOKENS.items()))
    tokens.chmod(0o600)
    serve = ServeProcess("--host", "127.0.0.1", "--port", "0", "--token-file", str(tokens))
    try:
        address, _ = serve.wait_listening()
        values = np.arange(N, dtype=np.float32)
        c = client(address, "tok-train")
        try:
            c.register_buffer("g", "w", N)
            c.set_params("g", "w", values)
        finally:
            c.close()
        yield serve, address, values
    finally:
        serve.stop()


def answered(serve: ServeProcess, code: grpc.StatusCode, details: str) -> None:
    """The call succeeded and the server lives (a SIGBUS ends it with exit -7)."""
    if code != grpc.StatusCode.OK:
        try:
            serve.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    died = serve.proc.poll()
    assert died is None, f"the server died (exit {died}); stderr: {serve.stderr[-5:]}"
    assert code == grpc.StatusCode.OK, (code, details)


def resize(seg: Segment) -> list[int]:
    """Tries to grow, then to shrink the segment under the server's mapping; the sizes that
    took."""
    took = []
    for size in (2 * seg.nbytes, 0):
        try:
            os.ftruncate(seg.fd, size)
            took.append(size)
        except PermissionError:
            pass
    return took


# -- finding 1: segments sealed against shrinking and growing --------------------------------
def test_a_read_token_cannot_shrink_its_reply_segment_under_the_server(served) -> None:
    """Before: the read token's ``ftruncate(fd, 0)`` took, and the PullParams that wrote the
    reply there killed the server with SIGBUS."""
    serve, address, values = served
    seg = Segment(address, "tok-read")
    try:
        assert is_sealed(seg.fd, seg.nbytes) and SEALS
        took = resize(seg)
        pull = pb.PullParamsRequest(
            ref=REF, chunk=pb.Chunk(offset=0, numel=N, dtype=pb.FLOAT32), reply_shm=seg.ref()
        )
        code, details, reply = raw(address, "PullParams", pull, "tok-read")
        answered(serve, code, details)
        assert took == [], f"the caller resized its segment to {took}"
        header = pb.PullParamsReply.FromString(reply).header
        assert header.shm.segment == seg.id and header.shm.nbytes == values.nbytes
        np.testing.assert_array_equal(np.frombuffer(seg.map, np.float32, N), values)
    finally:
        seg.close()


def test_a_train_token_cannot_shrink_a_segment_it_sets_params_from(served) -> None:
    serve, address, values = served
    seg = Segment(address, "tok-train")
    try:
        new = values + 1
        seg.map[: new.nbytes] = new.tobytes()
        took = resize(seg)
        header = pb.SetParamsHeader(
            ref=REF,
            chunk=pb.Chunk(offset=0, numel=N, dtype=pb.FLOAT32),
            version=0,
            shm=seg.ref(new.nbytes),
        )
        code, details, _ = raw(address, "SetParams", (header, b""), "tok-train")
        answered(serve, code, details)
        assert took == [], f"the caller resized its segment to {took}"
    finally:
        seg.close()
    c = client(address, "tok-other")
    try:  # another caller reads what the segment held, and the server still serves
        np.testing.assert_array_equal(c.pull_params("g", "w", N), new)
    finally:
        c.close()


def test_an_unsealed_segment_is_refused_at_confirm(monkeypatch) -> None:
    """The seals are checked at confirm (a kernel that dropped them, a bug): the segment is
    refused, and a client sends its payloads in-band instead."""
    from paramshard.server import ShardServer
    from paramshard.server.transport import segment_files

    monkeypatch.setattr(segment_files, "seal", lambda fd: None)
    with ShardServer(local_calls=False) as server:
        seg = Segment(server.address, None, confirm=False)
        try:
            assert not is_sealed(seg.fd, seg.nbytes)
            code, details = seg.confirm()
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "not sealed" in details
        finally:
            seg.close()
        c = client(server.address, None)
        try:
            c.register_buffer("j", "w", N)
            c.set_params("j", "w", np.ones(N, np.float32))
            np.testing.assert_array_equal(c.pull_params("j", "w", N), np.ones(N, np.float32))
            assert c.shm.opened == 0 and server.servicer.segments.views == 0
        finally:
            c.close()


# -- finding 3: a reply header names only the reader's own segment ---------------------------
def contribution(key: str, seg: Segment, values: np.ndarray, op: int, contributor: int) -> tuple:
    seg.map[: values.nbytes] = values.tobytes()
    header = pb.SlotHeader(
        key=key,
        op=op,
        expected=2 if op == pb.SUM else 1,
        readers=2,
        total_numel=values.size,
        chunk_numel=values.size,
        chunk=pb.Chunk(offset=0, numel=values.size, dtype=pb.FLOAT32),
        contributor=contributor,
        shm=seg.ref(values.nbytes),
    )
    return header, b""


@pytest.mark.parametrize("op", [pb.SET, pb.SUM], ids=["mailbox", "sum"])
def test_a_slot_reader_never_gets_the_writers_segment(op: int) -> None:
    """Before: the slot kept the first contribution's header, its ``shm`` included, and every
    reader's reply repeated it: an in-band reader got the writer's segment id and size."""
    from paramshard.server import ShardServer

    with ShardServer(local_calls=False, tokens=TOKENS) as server:
        address, key = server.address, f"r:probe-{op}/0"
        values = np.arange(N, dtype=np.float32)
        writers = [Segment(address, "tok-train"), Segment(address, "tok-other")]
        mine = Segment(address, "tok-other")
        try:
            for rank, seg in enumerate(writers[: 2 if op == pb.SUM else 1]):
                code, details, _ = raw(
                    address, "Contribute", contribution(key, seg, values, op, rank), seg.token
                )
                assert code == grpc.StatusCode.OK, details
            expected = values * (2 if op == pb.SUM else 1)
            # an in-band reader: the reply carries the values and no segment at all
            read = pb.ReadSlotRequest(key=key, offset=0, reader=0)
            code, details, reply = raw(address, "ReadSlot", read, "tok-other")
            assert code == grpc.StatusCode.OK, details
            got = pb.ReadSlotReply.FromString(reply)
            assert not got.header.HasField("shm"), f"an in-band reply names {got.header.shm}"
            fields = {field.name for field, _ in got.header.ListFields()}
            assert fields <= {
                "key",
                "op",
                "expected",
                "readers",
                "total_numel",
                "chunk_numel",
                "chunk",
            }
            np.testing.assert_array_equal(np.frombuffer(got.data, np.float32), expected)
            # a reader with a segment of its own: the reply names that one, and only that one
            read = pb.ReadSlotRequest(key=key, offset=0, reader=1, reply_shm=mine.ref())
            code, details, reply = raw(address, "ReadSlot", read, "tok-other")
            assert code == grpc.StatusCode.OK, details
            header = pb.ReadSlotReply.FromString(reply).header
            assert header.shm == mine.ref(values.nbytes)
            np.testing.assert_array_equal(np.frombuffer(mine.map, np.float32, N), expected)
        finally:
            for seg in (*writers, mine):
                seg.close()


# -- finding 2: the handover socket serves connections at once --------------------------------
IDLER = """
import socket, sys, time
held = []
for _ in range(int(sys.argv[2])):
    held.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    held[-1].connect("\\0" + sys.argv[1])
print("ready", flush=True)
time.sleep(60)
"""


def closed_by_server(conns: list[socket.socket], within: float) -> list[int]:
    """The indices of ``conns`` the server closed (end of stream) within ``within`` s."""
    ends = set()
    deadline = time.monotonic() + within
    while len(ends) < len(conns) and time.monotonic() < deadline:
        ready, _, _ = select.select([c for i, c in enumerate(conns) if i not in ends], [], [], 0.1)
        ends |= {conns.index(c) for c in ready if c.recv(1) == b""}
    return sorted(ends)


def test_idle_connections_to_the_handover_socket_delay_no_claim() -> None:
    """Before: the socket served one connection at a time, giving each 1 s for its ticket;
    12 idle connections of another process (no token needed) held a trainer's claim past
    the client's 5 s, and the client then sent everything in-band to that server for good."""
    from paramshard.server import ShardServer

    with ShardServer(local_calls=False) as server:
        name = offer(server.address, None).socket[1:]
        idler = subprocess.Popen(
            [sys.executable, "-c", IDLER, name, "12"], stdout=subprocess.PIPE, text=True
        )
        try:
            assert idler.stdout.readline().strip() == "ready"
            c = client(server.address, None)
            try:
                values = np.arange(N, dtype=np.float32)
                c.register_buffer("j", "w", N)
                c.set_params("j", "w", values)
                np.testing.assert_array_equal(c.pull_params("j", "w", N), values)
                assert c.shm.opened >= 1, "the client gave up shared memory with this server"
                assert server.servicer.segments.views >= 2  # the set and the pull went there
            finally:
                c.close()
        finally:
            idler.kill()
            idler.wait()


def test_a_peer_holds_few_handover_connections_and_none_for_long() -> None:
    """One process's connections past PER_PEER close its oldest; one that sends no ticket is
    closed after HANDOVER_S; a claim made meanwhile goes through."""
    from paramshard.server import ShardServer
    from paramshard.server.transport import handover

    with ShardServer(local_calls=False) as server:
        offered = offer(server.address, None)
        conns = []
        try:
            for _ in range(3 * handover.PER_PEER):
                conns.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
                conns[-1].connect("\0" + offered.socket[1:])
            early = closed_by_server(conns, within=handover.HANDOVER_S / 2)
            assert early == list(range(2 * handover.PER_PEER)), early
            fd = claim(offered.socket, offered.ticket)  # the newest: served at once
            os.close(fd)
            assert closed_by_server(conns, within=3 * handover.HANDOVER_S) == list(
                range(len(conns))
            )
        finally:
            for conn in conns:
                conn.close()


# -- finding 4: read tokens' segments come from a pool of their own --------------------------
def test_read_tokens_segments_never_take_trainers_memory() -> None:
    """Before: with --max-memory 512MiB a read token confirmed 8 segments of 64 MiB (pages
    never touched), all of the budget, and a trainer's RegisterBuffer of 1M floats then got
    RESOURCE_EXHAUSTED. Read tokens' segments come from READ_POOL_BYTES now, never from the
    budget, and still take the read token's replies."""
    from paramshard.server import ShardServer
    from paramshard.server.transport import read_pool

    with ShardServer(local_calls=False, tokens=TOKENS, max_memory="512MiB") as server:
        address, held = server.address, []
        try:
            refusal = ""
            for _ in range(8):
                request = pb.OfferSegmentRequest(nbytes=64 * 2**20)
                code, details, reply = raw(address, "OfferSegment", request, "tok-read")
                if code != grpc.StatusCode.OK:
                    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
                    refusal = details
                    break
                offered = pb.OfferSegmentReply.FromString(reply)
                held.append(Segment(address, "tok-read", offered=offered))
            c = client(address, "tok-train")
            try:
                values = np.arange(2**20, dtype=np.float32)
                c.register_buffer("big", "w", values.size)
                c.set_params("big", "w", values)
            finally:
                c.close()
            assert "read tokens' segments come from a pool" in refusal, refusal
            assert 0 < len(held) * 64 * 2**20 <= read_pool.READ_POOL_BYTES
            assert server.servicer.budget.usage()["shm"] == 0  # the budget is the trainers'
            pull = pb.PullParamsRequest(
                ref=pb.BufferRef(job="big", buffer="w"),
                chunk=pb.Chunk(offset=0, numel=values.size, dtype=pb.FLOAT32),
                reply_shm=held[0].ref(),
            )
            code, details, _ = raw(address, "PullParams", pull, "tok-read")
            assert code == grpc.StatusCode.OK, details
            np.testing.assert_array_equal(
                np.frombuffer(held[0].map, np.float32, values.size), values
            )
        finally:
            for seg in held:
                seg.close()
        release = pb.ReleaseSegmentsRequest(segments=[seg.id for seg in held])
        code, details, reply = raw(address, "ReleaseSegments", release, "tok-read")
        assert pb.ReleaseSegmentsReply.FromString(reply).released == len(held)
        assert server.servicer.segments.usage() == (0, 0)


def test_a_read_token_takes_half_of_the_read_pool_at_most() -> None:
    """Before: one read token's four segments of 32 MiB took all of READ_POOL_BYTES, and
    another team's reader got none (its replies in-band) until they were released or idled
    out (10 minutes). A read token now holds READ_SHARE_BYTES at most, the other half is left
    to another, and a token's release gives it its share back."""
    from paramshard.server import ShardServer
    from paramshard.server.transport import read_pool

    size = read_pool.READ_POOL_BYTES // 4
    with ShardServer(local_calls=False, tokens=TOKENS) as server:
        held: dict[str, list[Segment]] = {"tok-read": [], "tok-read2": []}

        def take(token: str) -> str:
            """Offers segments of ``size`` until refused; the refusal."""
            for _ in range(read_pool.MAX_READ_SEGMENTS):
                request = pb.OfferSegmentRequest(nbytes=size)
                code, details, reply = raw(server.address, "OfferSegment", request, token)
                if code != grpc.StatusCode.OK:
                    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
                    return details
                offered = pb.OfferSegmentReply.FromString(reply)
                held[token].append(Segment(server.address, token, offered=offered))
            return ""

        try:
            for token, segments in held.items():
                refusal = take(token)
                assert len(segments) == 2, (token, refusal)
                assert f"{read_pool.READ_SHARE_BYTES:,} bytes per token" in refusal
            first = held["tok-read"]
            release = pb.ReleaseSegmentsRequest(segments=[seg.id for seg in first])
            code, details, _ = raw(server.address, "ReleaseSegments", release, "tok-read")
            assert code == grpc.StatusCode.OK, details
            for seg in first:
                seg.close()
            first.clear()
            take("tok-read")
            assert len(first) == 2  # its share back
        finally:
            for segments in held.values():
                for seg in segments:
                    seg.close()
