"""``train_with_recovery`` recovers a model whose state the servers hold (ZeRO-1/2, FSDP, 3D).
A DDP model keeps its parameters and optimizer state in each trainer: given one, it says so
by name before any step. Before, a field review's DDP script failed on both ranks with
``AttributeError: 'DDPModel' object has no attribute 'registered'``."""

from __future__ import annotations

import pytest
import torch

from paramshard.client import ClusterSpec, ShardClient
from paramshard.strategies import DDPModel, ShardingConfiguration, train_with_recovery

pytestmark = pytest.mark.timeout(60)


def test_a_ddp_model_is_refused_by_name_before_any_step(servers) -> None:
    client = ShardClient(ClusterSpec([servers(1)[0].address]), rank=0, world_size=1, run_id="d")
    try:
        model = DDPModel(torch.nn.Linear(4, 2), ShardingConfiguration(client, job="ddp"))
        steps: list[int] = []
        with pytest.raises(TypeError, match=r"whose state the servers hold .* not a DDPModel"):
            train_with_recovery(model, lambda s: steps.append(s) or 0.0, 3)
        assert steps == []
    finally:
        client.close()
