"""Issue 13, finding 4: waiting calls starved working ones, each reproduced over real gRPC.

With 8 worker threads, 8 ``read``-token PullParams waiting for a far version made a ``train``
PushGrad hit DEADLINE_EXCEEDED; 4 unauthenticated reflection streams blocked an admin Status
the same way. Now waiting calls are bounded (per role, and never into the threads kept for
calls that work), refused at once beyond the bound, and streams run on threads of their own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from paramshard.client import ClusterSpec, ShardClient, StepArgs
from paramshard.protos import shard_pb2 as pb

N = 8
TOKENS = {"reader": "read", "trainer": "train", "admin": "admin"}
SHARD = "/paramshard.v1.Shard/"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture
def channels() -> Iterator[Any]:
    opened: list[grpc.Channel] = []

    def open_channel(address: str) -> grpc.Channel:
        opened.append(grpc.insecure_channel(address))
        return opened[-1]

    yield open_channel
    for chan in opened:
        chan.close()


def far_pulls(chan: grpc.Channel, token: str, count: int) -> list[grpc.Future]:
    """``count`` PullParams of job j for version 100, which never comes."""
    pull = chan.unary_unary(
        SHARD + "PullParams",
        request_serializer=pb.PullParamsRequest.SerializeToString,
        response_deserializer=lambda raw: raw,
    )
    req = pb.PullParamsRequest(
        ref=pb.BufferRef(job="j", buffer="b"),
        chunk=pb.Chunk(offset=0, numel=N, dtype=pb.FLOAT32),
        min_version=100,
    )
    return [pull.future(req, timeout=30, metadata=bearer(token)) for _ in range(count)]


def settle(condition: Any, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def refused(futures: list[grpc.Future]) -> list[str]:
    """Details of the futures that failed with RESOURCE_EXHAUSTED (the others still wait)."""
    out = []
    for f in futures:
        if f.done():
            assert f.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (f.code(), f.details())
            out.append(f.details())
    return out


def test_waiting_pulls_cannot_starve_a_trainers_push_and_step(servers, channels) -> None:
    (server,) = servers(
        1, tokens=TOKENS, max_workers=8, reserved_workers=2, max_waiting_read=4, max_wait_s=20
    )
    trainer = ShardClient(
        ClusterSpec([server.address], token="trainer"), rank=0, world_size=1, timeout_s=3.0
    )
    admin = ShardClient(
        ClusterSpec([server.address], token="admin"), rank=0, world_size=1, timeout_s=3.0
    )
    waiters: list[grpc.Future] = []
    try:
        trainer.register_buffer("j", "b", N, hyper={"lr": 1.0})
        trainer.set_params("j", "b", np.zeros(N, np.float32))
        gate = server.gate

        # Eight read-token pulls for a far version: four wait, four are refused at once.
        reads = far_pulls(channels(server.address), "reader", 8)
        waiters += reads
        settle(lambda: gate.waiting["read"] == 4 and sum(f.done() for f in reads) == 4, "reads")
        details = refused(reads)
        assert len(details) == 4
        assert all("PullParams: 4 calls of read tokens already wait" in d for d in details)
        assert "--max-waiting-read" in details[0]

        # Trainers' pulls take the free threads, never the two kept for working calls.
        trains = far_pulls(channels(server.address), "trainer", 4)
        waiters += trains
        settle(lambda: sum(f.done() for f in trains) == 2 and gate.busy == 6, "train pulls")
        details = refused(trains)
        assert len(details) == 2
        kept = "8 worker threads and 2 are kept for calls that do not wait (pushes, steps, Status)"
        assert all(d.startswith("PullParams: 6 calls are running") and kept in d for d in details)

        # Every waiting bound is full: a push and a step still go through (within the
        # trainer's 3 s deadline, which they missed before), and so does an admin's Status.
        trainer.push_grads("j", "b", np.ones(N, np.float32), step=0)
        trainer.step("j", 0, {"b": StepArgs({"lr": 1.0})})
        status = admin.status()[0]
        (row,) = status["jobs"][0]["buffers"]
        assert int(row["version"]) == 1
        np.testing.assert_array_equal(trainer.pull_params("j", "b", N, 1), -np.ones(N))

        # One more read waiter is refused at once; the ones admitted still wait.
        (extra,) = far_pulls(channels(server.address), "reader", 1)
        with pytest.raises(grpc.RpcError) as err:
            extra.result(timeout=2.0)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert sum(not f.done() for f in waiters) == 6
    finally:
        for f in waiters:
            f.cancel()
        trainer.close()
        admin.close()


def test_a_pull_waits_at_most_max_wait_s(servers) -> None:
    (server,) = servers(1, max_wait_s=0.5, local_calls=False)
    c = ShardClient(ClusterSpec([server.address]), rank=0, world_size=1, timeout_s=30.0)
    try:
        c.register_buffer("j", "b", N)
        c.set_params("j", "b", np.zeros(N, np.float32))
        began = time.monotonic()
        with pytest.raises(Exception) as err:
            c.pull_params("j", "b", N, 100)
        assert time.monotonic() - began < 5.0
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "waited 0.5 s for version 100" in err.value.details
        settle(lambda: server.gate.busy == 0 and not +server.gate.waiting, "the gate to empty")
    finally:
        c.close()


def test_reflection_streams_are_bounded_and_never_block_status(servers, channels) -> None:
    (server,) = servers(1, tokens=TOKENS, max_workers=4, reserved_workers=1, max_streams=2)
    stop = threading.Event()

    def requests() -> Iterator[Any]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        stop.wait(30)  # the stream stays open, as an idle grpcurl session's does

    info = channels(server.address).stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    streams = [info(requests(), timeout=30) for _ in range(6)]  # no token: reflection is open
    admin = ShardClient(
        ClusterSpec([server.address], token="admin"), rank=0, world_size=1, timeout_s=3.0
    )
    try:
        answered, codes = 0, []
        for s in streams:
            try:
                reply = next(s)
                assert "paramshard.v1.Shard" in str(reply.list_services_response)
                answered += 1
            except grpc.RpcError as exc:
                codes.append(exc.code())
                assert "--max-streams" in exc.details()
        assert answered == 2 and codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4
        assert admin.status()[0]["version"]  # within its 3 s deadline, which it missed before
    finally:
        stop.set()
        for s in streams:
            s.cancel()
        admin.close()
    settle(lambda: server.gate.streams == 0, "the streams to close")
