"""A snapshot loaded as another job (``RestoreRequest.into``, ``tools.restore(into=...)``):
beside the live job, which stays as it is. ``HybridShardedModel.load_checkpoint`` reads a
snapshot of another layout this way (client/carry.py). The servers make a new job only: a name
they hold is refused, and so is one that is no job name, with nothing changed.
"""

from __future__ import annotations

import uuid

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient, ShardClientError, StepArgs, tools
from paramshard.client.jobs import server_jobs
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.runtime.request_bounds import MAX_NAME

N = 96


@pytest.fixture
def servers(tmp_path):
    nodes = [ShardServer("127.0.0.1", 0, snapshot_dir=str(tmp_path)).start() for _ in range(2)]
    yield nodes
    for n in nodes:
        n.stop(0)


def _step(c: ShardClient, job: str, version: int, seed: int) -> None:
    grad = np.random.default_rng(seed).standard_normal(N).astype(np.float32)
    c.push_grads(job, "w", grad, version)
    c.step(job, version, {"w": StepArgs({"lr": 0.1})})


def _moments(c: ShardClient, job: str, version: int) -> np.ndarray:
    out = np.empty(N, dtype=np.float32)
    c.run(c.pull_calls(job, "w", out, version, state="exp_avg"))
    return out


def test_a_snapshot_loaded_as_another_job_leaves_the_live_one(servers):
    job = f"into-{uuid.uuid4().hex[:6]}"
    c = ShardClient(ClusterSpec([n.address for n in servers]), timeout_s=20)
    try:
        c.register_buffer(job, "w", N, optimizer="adam", hyper={"lr": 0.1})
        c.set_params(job, "w", np.linspace(-1, 1, N, dtype=np.float32))
        _step(c, job, 0, 1)
        tools.snapshot(c, job, "one")
        at_one = c.pull_params(job, "w", N, 1)
        moments = _moments(c, job, 1)
        _step(c, job, 1, 2)
        live = c.pull_params(job, "w", N, 2)
        assert not np.array_equal(live, at_one)

        old = f"{job}-old"
        assert tools.restore(c, job, "one", into=old) == 1
        assert np.array_equal(c.pull_params(old, "w", N, 1), at_one)
        assert np.array_equal(_moments(c, old, 1), moments)
        assert np.array_equal(c.pull_params(job, "w", N, 2), live)  # the live job as it was
        held = server_jobs(c)
        assert {b.version for b in held.status[job].buffers} == {2}

        # a name the servers hold, the live job's own included, is refused; nothing changes
        for taken in (old, job):
            with pytest.raises(ShardClientError) as err:
                tools.restore(c, job, "one", into=taken)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert f"a job '{taken}' is on this server already" in err.value.details
        assert np.array_equal(c.pull_params(job, "w", N, 2), live)
        assert np.array_equal(c.pull_params(old, "w", N, 1), at_one)

        # no job name (too long): refused as a registration of it would be
        name = "x" * (MAX_NAME + 1)
        with pytest.raises(ShardClientError) as err:
            c.call(0, "Restore", pb.RestoreRequest(job=job, tag="one", num_servers=1, into=name))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value.details
        assert "a job name has 1.." in err.value.details
        # a check only makes nothing
        c.call(0, "Restore", pb.RestoreRequest(job=job, tag="one", num_servers=1, into="x-new",
                                                check_only=True))  # fmt: skip
        assert "x-new" not in server_jobs(c).jobs
        c.drop_job(old)
        assert sorted(server_jobs(c).jobs) == [job]
    finally:
        c.close()
