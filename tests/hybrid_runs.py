"""3D-parallel training runs for the tests of snapshots, export and restore of hybrid jobs
(tests/test_hybrid_export.py, test_hybrid_parts.py, test_checkpoint_retention.py,
test_stop_the_others.py): a float64 tiny GPT trained by ranks as threads, each with one
client, and the checks of the whole model those tests share."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from paramshard.client import ClusterSpec, ShardClient, tools
from paramshard.models.gpt import GPT, GPTConfig
from paramshard.strategies import HybridShardedModel, HybridShardedOptimizer, ShardingConfiguration

BATCH = 8
FIRST, AGAIN = 3, 2  # steps before the checkpoint, steps after it (done twice)
CFG = GPTConfig.tiny(vocab_size=50, bias=False, n_layer=4)  # tied embeddings (the default)


def initial_weights(seed: int = 0, cfg: GPTConfig = CFG) -> dict[str, torch.Tensor]:
    """Float64 initial weights."""
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in GPT(cfg).double().state_dict().items()}


def new_gpt(cfg: GPTConfig = CFG) -> GPT:
    return GPT(cfg).double()


def batches(steps: int) -> torch.Tensor:
    return torch.randint(0, 50, (steps, BATCH, 17), generator=torch.Generator().manual_seed(1))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


def run_hybrid(
    pp: int,
    tp: int,
    dp: int,
    addresses: list[str],
    job: str,
    body: Any,
    make_opt: Any = adamw,
    cfg: GPTConfig = CFG,
) -> list:
    """``body(model, opt, train)`` on every rank of a (pp, tp, dp) world, as threads; ``train(s)``
    runs step ``s`` of ``batches`` on this rank's share and returns the loss."""
    world = pp * tp * dp
    run = uuid.uuid4().hex[:6]
    data = batches(FIRST + AGAIN)
    init = initial_weights(cfg=cfg)  # once: the threads share torch's global generator

    def rank(r: int) -> Any:
        client = ShardClient(
            ClusterSpec(addresses), rank=r, world_size=world, run_id=run, timeout_s=60
        )
        try:
            config = ShardingConfiguration(client, job=job)
            net = new_gpt(cfg)
            net.load_state_dict(init)
            model = HybridShardedModel(
                net,
                config,
                pipeline_parallel_size=pp,
                tensor_parallel_size=tp,
                data_parallel_size=dp,
                micro_batch_count=2,
            )
            opt = HybridShardedOptimizer(make_opt(model.parameters()), config)
            per, d = BATCH // model.data_parallel_size, model.data_parallel_rank

            def train(s: int) -> float:
                part = data[s, d * per : (d + 1) * per]
                return model.train_on_batch(part[:, :-1], part[:, 1:])

            return body(model, opt, train)
        finally:
            client.close()

    with ThreadPoolExecutor(world) as pool:
        return [f.result(timeout=300) for f in [pool.submit(rank, r) for r in range(world)]]


def checkpoint_and_replay(model: Any, opt: Any, train: Any) -> dict[str, Any]:
    """Train FIRST steps, save "t1", train AGAIN steps, load "t1", train them again."""
    for s in range(FIRST):
        train(s)
    version = model.save_checkpoint("t1")
    at_t1 = model.state_dict()
    first = [train(s) for s in range(FIRST, FIRST + AGAIN)]
    after_first = model.state_dict()
    assert model.load_checkpoint("t1") == version
    reloaded = model.state_dict()
    again = [train(s) for s in range(FIRST, FIRST + AGAIN)]
    return {
        "version": version,
        "t1": at_t1,
        "first": first,
        "after_first": after_first,
        "reloaded": reloaded,
        "again": again,
        "final": model.state_dict(),
    }


def client_for(addresses: list[str]) -> ShardClient:
    return ShardClient(ClusterSpec(addresses), timeout_s=30.0)


def assert_equal_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], who: str):
    assert set(got) == set(want), (who, set(got) ^ set(want))
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, (who, name)
        assert torch.equal(got[name], value), f"{who}: {name} differs"


def live_export(addresses: list[str], job: str, out: Path) -> dict[str, torch.Tensor]:
    c = client_for(addresses)
    try:
        count = tools.export(c, job, out)
    finally:
        c.close()
    loaded = load_file(str(out))
    assert count == len(loaded)
    return loaded
