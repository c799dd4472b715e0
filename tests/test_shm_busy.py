"""A call refused "retry later" keeps its shared segment (client/futures.py ``ShmFuture``).

A busy server's refusal is a status it sends once its handler is done with the call's segment
(or never touched it), so the retry takes the same segment again. Before, every refusal
retired it, and each retry opened, mapped and faulted in a new one (two more calls to the
server and the pull's whole size in fresh pages). Real server on 127.0.0.1:0 with tokens.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.client import rpc as client_rpc
from paramshard.protos import shard_pb2 as pb

pytestmark = pytest.mark.timeout(60)

N = 100_000  # 400 KB a pull: through a shared segment (protos/shm.py SHM_MIN_BYTES)
TOKENS = {"reader": "read", "trainer": "train"}


def test_retries_of_a_busy_refusal_reuse_their_segment(servers, monkeypatch) -> None:
    (server,) = servers(1, tokens=TOKENS, max_waiting_read=1, local_calls=False)
    trainer = ShardClient(ClusterSpec([server.address], token="trainer"), timeout_s=10.0)
    reader = ShardClient(
        ClusterSpec([server.address], token="reader"), timeout_s=1.5, sessions=False
    )
    chan = grpc.insecure_channel(server.address)
    try:
        trainer.register_buffer("j", "b", N, hyper={"lr": 0.1})
        trainer.set_params("j", "b", np.arange(N, dtype=np.float32))
        np.testing.assert_array_equal(reader.pull_params("j", "b", N, 0), np.arange(N))
        assert reader.shm.opened == 1

        # another reader's pull for a far version takes the one place read tokens may wait in
        pull = chan.unary_unary(
            "/paramshard.v1.Shard/PullParams",
            request_serializer=pb.PullParamsRequest.SerializeToString,
        )
        far = pb.PullParamsRequest(
            ref=pb.BufferRef(job="j", buffer="b"),
            chunk=pb.Chunk(offset=0, numel=N, dtype=pb.FLOAT32),
            min_version=100,
        )
        waiter = pull.future(far, timeout=20, metadata=(("authorization", "Bearer reader"),))
        deadline = time.monotonic() + 10
        while server.gate.waiting["read"] < 1:  # it waits there
            assert time.monotonic() < deadline and not waiter.done(), waiter
            time.sleep(0.02)
        pauses = []
        real = client_rpc.busy_pause
        monkeypatch.setattr(client_rpc, "busy_pause", lambda *a: pauses.append(a) or real(*a))
        with pytest.raises(ShardClientError) as err:  # refused and asked again until 1.5 s
            reader.pull_params("j", "b", N, 5)
        assert len(pauses) >= 3, pauses  # it was asked again
        assert reader.shm.opened == 1  # every attempt in the same segment (before: one each)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert "retry later" in err.value.details

        waiter.cancel()
        np.testing.assert_array_equal(reader.pull_params("j", "b", N, 0), np.arange(N))
        assert reader.shm.opened == 1
    finally:
        chan.close()
        reader.close()
        trainer.close()
