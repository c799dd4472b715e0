"""A rank that comes to an elastic job while one of its servers is being rebuilt (a node lost
its trainer and its server at once: the launcher restarts both, the server empty) waits for
the running ranks to rebuild that server, then joins at their step
(``ElasticSteps._await_rebuilt``). Before, it found the job at step N on some servers and
holding nothing on the restarted one, raised "on the servers at several versions [0, N]" and
spent a restart: in a field check 18 runs of 18, and with ``--max-restarts 1`` the rank left
the job for good. Real in-process servers on 127.0.0.1; the rebuild is the one the running
ranks' recovery makes (``recover_from_replicas``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_elastic import BATCH, INIT, LR, data, net

from paramshard.client import ClusterSpec, ShardClient, tools
from paramshard.protos import shard_pb2 as pb
from paramshard.strategies import FSDPModel, FSDPOptimizer, ShardingConfiguration

pytestmark = pytest.mark.timeout(300)
JOB, STEPS = "rebuilt", 2


def rank(addresses: list[str], r: int) -> tuple[ShardClient, FSDPModel, FSDPOptimizer]:
    client = ShardClient(
        ClusterSpec(addresses), rank=r, world_size=2, run_id="rb", timeout_s=60, retries=2
    )
    config = ShardingConfiguration(client, job=JOB, elastic=True, replicate_every=1)
    model = FSDPModel(net(INIT), config, wrap=(torch.nn.Linear,))
    opt = FSDPOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), config)
    return client, model, opt


def test_a_rank_that_comes_while_a_server_is_rebuilt_waits_and_joins(servers) -> None:
    nodes = servers(2)
    addresses = [s.address for s in nodes]
    x, y = data()
    client0, model0, opt0 = rank(addresses, 0)
    joined: list[object] = []
    try:
        for s in range(STEPS):  # rank 0 trains alone
            part = model0.batch_part(BATCH)
            torch.nn.functional.mse_loss(model0(x[s, part]), y[s, part]).backward()
            opt0.step()
            opt0.zero_grad()
        assert model0.step_count == STEPS
        client0.call(1, "DropJob", pb.DropJobRequest(job=JOB))  # server 1 restarted empty

        def comes() -> None:
            try:
                client1, model1, _ = rank(addresses, 1)
                joined.append(model1.step_count)
                client1.close()
            except Exception as exc:  # noqa: BLE001 - the test reads it
                joined.append(exc)

        newcomer = threading.Thread(target=comes, name="r1")
        newcomer.start()
        deadline = time.monotonic() + 60
        while JOB not in nodes[1].servicer.buffers.jobs():  # its registration reached server 1
            assert time.monotonic() < deadline and newcomer.is_alive(), joined
            time.sleep(0.05)
        time.sleep(1.5)  # several of its looks at the servers
        assert newcomer.is_alive(), f"the new rank did not wait for the rebuild: {joined}"
        assert tools.recover_from_replicas(client0, JOB) == STEPS  # the running rank rebuilds
        newcomer.join(60)
        assert not newcomer.is_alive() and joined == [STEPS], joined
    finally:
        client0.close()
