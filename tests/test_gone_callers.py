"""A call that waits, whose caller goes away, lets its handler thread go within a poll
(server/runtime/callers.py), not at its deadline. Before, only a Snapshot asked: a ReadSlot or
a PullParams of a version not reached, sent with a long deadline and then cancelled (a trainer
killed, a channel closed), held its thread until the deadline or the server's bound (120 s),
so six such calls of a closed channel held six threads for two minutes. Real servers on
127.0.0.1, called over gRPC, unary and in a session."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient
from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.runtime.run_names import ENDED_POLL_S

pytestmark = pytest.mark.timeout(120)

N = 2**19  # 4 MiB of float64: above WAITS_FROM_BYTES, so an early contribution waits its turn
LONG = 60.0  # each call's own deadline: far beyond the time the test allows for the release
RELEASED_WITHIN = 10 * ENDED_POLL_S  # a poll, with room for a loaded machine


@pytest.fixture
def server() -> Iterator[ShardServer]:
    with ShardServer(local_calls=False) as s:
        yield s


def settle(cond: Callable[[], bool], within: float, what: str) -> float:
    """Seconds until ``cond()`` holds, failing with ``what`` past ``within``."""
    began = time.monotonic()
    while not cond():
        assert time.monotonic() - began < within, what
        time.sleep(0.02)
    return time.monotonic() - began


def slot_header(key: str, contributor: int) -> pb.SlotHeader:
    return pb.SlotHeader(
        key=key, op=pb.SUM, expected=3, readers=3, total_numel=N, chunk_numel=N,
        contributor=contributor, chunk=pb.Chunk(offset=0, numel=N, dtype=pb.FLOAT64),
    )  # fmt: skip


def stub(chan: grpc.Channel, method: str, serializer: Callable) -> Callable:
    return chan.unary_unary(f"/paramshard.v1.Shard/{method}", request_serializer=serializer)


def waiting_readers(server: ShardServer, key: str) -> int:
    return sum(sum(s.waiting.values()) for s in server.servicer.slots.open_slots() if s.key == key)


def test_a_slot_read_whose_caller_cancelled_lets_its_thread_go(server: ShardServer) -> None:
    key = "run:gone/0"
    with grpc.insecure_channel(server.address) as chan:
        read = stub(chan, "ReadSlot", pb.ReadSlotRequest.SerializeToString)
        call = read.future(pb.ReadSlotRequest(key=key, reader=0), timeout=LONG)
        settle(lambda: waiting_readers(server, key) == 1, 10, "the read to wait")
        assert server.gate.busy == 1
        call.cancel()
        took = settle(
            lambda: waiting_readers(server, key) == 0, RELEASED_WITHIN, "the read waits on"
        )
        settle(lambda: server.gate.busy == 0, RELEASED_WITHIN, "its thread is still held")
    assert took < RELEASED_WITHIN


def test_a_pull_of_a_version_not_reached_ends_when_its_channel_closes(server: ShardServer) -> None:
    """The caller's channel closes under the call (a trainer's process ends)."""
    client = ShardClient(ClusterSpec([server.address]), timeout_s=30.0, retries=0)
    try:
        client.call(0, "RegisterBuffer", pb.RegisterBufferRequest(
            ref=pb.BufferRef(job="gone", buffer="w"), numel=8, num_servers=1, contributors=1,
            params=[pb.ParamEntry(name="w", shape=[8], offset=0, numel=8)],
            optimizer=pb.OptimizerSpec(name="sgd", hyper={"lr": 0.1}),
        ))  # fmt: skip
    finally:
        client.close()
    chan = grpc.insecure_channel(server.address)
    pull = stub(chan, "PullParams", pb.PullParamsRequest.SerializeToString)
    req = pb.PullParamsRequest(
        ref=pb.BufferRef(job="gone", buffer="w"),
        min_version=5,
        chunk=pb.Chunk(offset=0, numel=8, dtype=pb.FLOAT32),
    )
    call = pull.future(req, timeout=LONG)
    settle(lambda: server.gate.busy == 1, 10, "the pull to wait")
    time.sleep(2 * ENDED_POLL_S)
    assert not call.done()  # it waits: version 5 does not come
    chan.close()
    settle(lambda: server.gate.busy == 0, RELEASED_WITHIN, "the pull still holds its thread")


def test_an_early_contribution_waiting_its_turn_ends_with_its_caller(server: ShardServer) -> None:
    """Contribution 2 of 3 comes first and waits for its turn (server/runtime/turns.py, up to
    30 s), holding its 4 MiB request and a thread; cancelled, it lets both go."""
    key = "run:turn/0"
    payload = np.ones(N).tobytes()
    with grpc.insecure_channel(server.address) as chan:
        contribute = chan.unary_unary("/paramshard.v1.Shard/Contribute")
        call = contribute.future(codec.encode(slot_header(key, 2), payload), timeout=LONG)
        settle(lambda: server.servicer.slots.turns.waiting == 1, 10, "the contribution to wait")
        call.cancel()
        settle(
            lambda: server.servicer.slots.turns.waiting == 0 and server.gate.busy == 0,
            RELEASED_WITHIN,
            "the contribution still waits its turn",
        )


def test_a_session_read_ends_when_its_client_closes(server: ShardServer) -> None:
    """In a session the call's caller is the session's stream: a client that closes cancels
    it, and the read waiting on the server's pool thread ends with it."""
    key = "run:session/0"
    client = ShardClient(ClusterSpec([server.address]), timeout_s=LONG, retries=0)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            client.call(0, "ReadSlot", pb.ReadSlotRequest(key=key, reader=0))
        except BaseException as exc:  # noqa: BLE001 - the close ends it: read below
            errors.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        settle(lambda: waiting_readers(server, key) == 1, 10, "the read to wait")
        assert server.gate.sessions == 1  # the read came in the client's session
    finally:
        client.close()
    settle(lambda: waiting_readers(server, key) == 0, RELEASED_WITHIN, "the read waits on")
    settle(lambda: server.gate.busy == 0, RELEASED_WITHIN, "its thread is still held")
    t.join(10)
    assert not t.is_alive() and errors
