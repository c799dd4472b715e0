"""Issue 13's findings on flat buffers, each reproduced over real gRPC and now refused.

7. Coverage by adding up sizes: SetParams [0,6) then [1,7) marked an 8-element slice
   initialised with element 7 never written; PushGrad [0,4) then [2,6) counted as reduced with
   elements 2-3 doubled and 6-7 missing.
10. A parameter of shape [2**32, 2**32] with numel 0 registered (np.prod overflowed to 0); a
   snapshot waiting for v1 while SetParams jumped to v3 gave INTERNAL KeyError and kept a
   capture forever.
Each refused request leaves the server as it was.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ParamInfo, ShardClient, ShardClientError, StepArgs
from paramshard.client.rpc import Call
from paramshard.protos import shard_pb2 as pb

N = 8


@pytest.fixture
def client(servers: Any) -> Any:
    (server,) = servers(1, local_calls=False)  # every call crosses gRPC
    c = ShardClient(ClusterSpec([server.address]), rank=0, world_size=1, timeout_s=5.0)
    yield c, server
    c.close()


def set_chunk(c: ShardClient, job: str, lo: int, hi: int, version: int = 0) -> Any:
    header = pb.SetParamsHeader(
        ref=pb.BufferRef(job=job, buffer="b"),
        chunk=pb.Chunk(offset=lo, numel=hi - lo, dtype=pb.FLOAT32),
        version=version,
    )
    return c.run([Call(0, "SetParams", (header, np.arange(lo, hi, dtype=np.float32)))])[0]


def push_chunk(c: ShardClient, job: str, lo: int, hi: int) -> Any:
    header = pb.PushGradHeader(
        ref=pb.BufferRef(job=job, buffer="b"),
        chunk=pb.Chunk(offset=lo, numel=hi - lo, dtype=pb.FLOAT32),
        step=0,
        num_micro=1,
    )
    return c.run([Call(0, "PushGrad", (header, np.ones(hi - lo, dtype=np.float32)))])[0]


def buffer_row(c: ShardClient, job: str) -> dict[str, Any]:
    (row,) = [j for j in c.status()[0]["jobs"] if j["job"] == job]
    return row["buffers"][0]


def test_overlapping_set_params_chunks_are_refused(client: Any) -> None:
    c, _ = client
    c.register_buffer("j", "b", N)
    assert set_chunk(c, "j", 0, 6).initialized is False
    with pytest.raises(ShardClientError) as err:
        set_chunk(c, "j", 1, 7)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "[1, 7) overlaps chunk [0, 6)" in err.value.details
    assert buffer_row(c, "j")["initialized"] is False
    assert set_chunk(c, "j", 0, 6).initialized is False  # an exact retry is fine
    assert set_chunk(c, "j", 6, 8).initialized is True
    np.testing.assert_array_equal(c.pull_params("j", "b", N), np.arange(N, dtype=np.float32))


def test_overlapping_gradient_chunks_are_refused(client: Any) -> None:
    c, _ = client
    c.register_buffer("j", "b", N, hyper={"lr": 1.0})
    c.set_params("j", "b", np.zeros(N, np.float32))
    assert push_chunk(c, "j", 0, 4).reduced is False
    with pytest.raises(ShardClientError) as err:
        push_chunk(c, "j", 2, 6)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "[2, 6) overlaps chunk [0, 4)" in err.value.details
    assert push_chunk(c, "j", 0, 4).duplicate is True
    assert push_chunk(c, "j", 4, 8).reduced is True
    c.step("j", 0, {"b": StepArgs({"lr": 1.0})})
    np.testing.assert_array_equal(c.pull_params("j", "b", N, 1), -np.ones(N, np.float32))


def test_shapes_whose_product_overflows_int64_are_refused(client: Any) -> None:
    c, _ = client
    with pytest.raises(ShardClientError) as err:
        c.register_buffer("j", "b", 1, params=[ParamInfo("w", (2**32, 2**32), 0)])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'w'" in err.value.details
    assert c.status()[0]["jobs"] == []


def test_a_snapshot_whose_version_was_jumped_over_fails_cleanly(client: Any, tmp_path) -> None:
    c, server = client
    c.register_buffer("j", "b", N)
    c.set_params("j", "b", np.zeros(N, np.float32))
    store = server.servicer.buffers
    failed: list[BaseException] = []

    def capture() -> None:
        try:
            store.get("j", "b").capture(1, timeout=5.0)
        except BaseException as exc:  # noqa: BLE001 - the thread reports what it raised
            failed.append(exc)

    waiter = threading.Thread(target=capture)
    waiter.start()
    c.set_params("j", "b", np.ones(N, np.float32), version=3)  # a restore jumps to v3
    waiter.join(10)
    assert not waiter.is_alive()
    (exc,) = failed
    assert exc.code == grpc.StatusCode.FAILED_PRECONDITION, exc
    assert "without stepping through it" in str(exc)
    b = store.get("j", "b")
    assert b.captures == {} and not b.capture_requests


def test_a_timed_out_collective_names_the_missing_ranks(servers: Any) -> None:
    """Finding 11 (first part): the error says who is missing, not only how many arrived."""
    (server,) = servers(1, local_calls=False)
    c = ShardClient(ClusterSpec([server.address]), rank=0, world_size=3, timeout_s=0.5)
    try:
        with pytest.raises(ShardClientError) as err:
            c.all_reduce(np.ones(4, np.float32))  # ranks 1 and 2 never come
    finally:
        c.close()
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "1 of 3 contributions arrived; missing rank(s) 1, 2" in err.value.details
