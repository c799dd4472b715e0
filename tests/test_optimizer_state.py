"""``optimizer.state_dict()`` / ``load_state_dict()`` carry the servers' moments, in torch's
format: for ZeRO-1, ZeRO-2 and FSDP the state dict equals a plain torch optimizer's after the
same steps, and a plain torch optimizer's state dict resumes training exactly on fresh
servers (what FSDP users do with ``FSDP.optim_state_dict``).

Two ranks are threads with one client each, against two in-process servers; each rank trains
on its half of the batch, the reference on the whole batch. Float64 on both sides (the servers
keep float64 moments): losses, moments and resumed training within 1e-9 (tests/numerics.py).
"""

from __future__ import annotations

import copy
import uuid

import pytest
import torch
from numerics import assert_equivalent

from paramshard.models.gpt import GPT, Block, GPTConfig, lm_loss
from paramshard.strategies import (
    FSDPModel,
    FSDPOptimizer,
    ShardingConfiguration,
    ZeRO1Model,
    ZeRO1Optimizer,
    ZeRO2Model,
    ZeRO2Optimizer,
)

W, STEPS = 2, 3
CFG = GPTConfig.tiny(vocab_size=50, bias=False, n_layer=2)  # bias=False: see test_strategies
KINDS = {
    "zero1": (ZeRO1Model, ZeRO1Optimizer, {}),
    "zero2": (ZeRO2Model, ZeRO2Optimizer, {}),
    "fsdp": (FSDPModel, FSDPOptimizer, {"wrap": (Block,)}),
}
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}
_gen = torch.Generator().manual_seed(7)
DATA = torch.randint(0, 50, (2 * STEPS, 2 * W, 17), generator=_gen)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def init():
    torch.manual_seed(0)
    return copy.deepcopy(GPT(CFG).double().state_dict())


def new_gpt(state):
    net = GPT(CFG).double()
    net.load_state_dict(state)
    return net


def single_process(init, opt_name, steps):
    model = new_gpt(init)
    opt = OPTIMIZERS[opt_name](model.parameters())
    losses = []
    for s in steps:
        loss = lm_loss(model(DATA[s, :, :-1]), DATA[s, :, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def train_sharded(kind, opt_name, start_state, steps, addresses, load_opt=None):
    """Each rank: the wrapped model from ``start_state``, optionally ``opt.load_state_dict``,
    ``steps`` steps; returns (losses, optimizer state dict, model state dict) per rank."""
    model_cls, opt_cls, kw = KINDS[kind]
    job = f"optstate-{uuid.uuid4().hex[:8]}"

    def rank(client):
        net = new_gpt(start_state)
        model = model_cls(net, ShardingConfiguration(client, job=job), **kw)
        opt = opt_cls(OPTIMIZERS[opt_name](model.parameters()), model.config)
        if load_opt is not None:
            opt.load_state_dict(load_opt)
        losses = []
        half = slice(2 * client.rank, 2 * client.rank + 2)
        for s in steps:
            x, y = DATA[s, half, :-1], DATA[s, half, 1:]
            losses.append(model.train_on_batch(x, y))
        losses = [
            float(client.all_reduce(torch.tensor([v], dtype=torch.float64), "mean")[0])
            for v in losses
        ]
        return losses, opt.state_dict(), model.state_dict()

    from tests.conftest import run_ranks

    return run_ranks(rank, W, addresses, timeout_s=20.0, wait_s=60.0)


@pytest.mark.equivalence
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_state_dict_equals_torch_and_resumes_on_fresh_servers(servers, init, kind, opt_name):
    first, rest = range(STEPS), range(STEPS, 2 * STEPS)
    ref_model, ref_opt, ref_losses = single_process(init, opt_name, first)
    ref_sd = ref_opt.state_dict()
    _, _, ref_later = single_process(init, opt_name, range(2 * STEPS))

    addresses = [s.address for s in servers(2)]
    for losses, sd, _ in train_sharded(kind, opt_name, init, first, addresses):
        assert_equivalent(losses, ref_losses, "losses")
        assert sd["param_groups"] == ref_sd["param_groups"]
        assert sd["state"].keys() == ref_sd["state"].keys()
        for index, want in ref_sd["state"].items():
            got = sd["state"][index]
            assert got.keys() == want.keys(), index
            assert_equivalent(got, want, f"param {index}")

    # A plain torch optimizer's state dict resumes on new servers: the next steps' losses are
    # the uninterrupted run's.
    fresh = [s.address for s in servers(2)]
    state = copy.deepcopy(ref_model.state_dict())
    results = train_sharded(kind, opt_name, state, rest, fresh, load_opt=ref_sd)
    for losses, _, _ in results:
        assert_equivalent(losses, ref_later[STEPS:], "losses after resuming")


def test_load_rejects_a_state_of_the_wrong_shape(servers, init):
    addresses = [s.address for s in servers(2)]
    _, ref_opt, _ = single_process(init, "adamw", range(1))
    bad = copy.deepcopy(ref_opt.state_dict())
    bad["state"][0]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="exp_avg.*shape \\[3\\]"):
        train_sharded("zero1", "adamw", init, range(0), addresses, load_opt=bad)
