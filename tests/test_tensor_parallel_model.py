"""``TensorParallelModel``: a whole GPT split over tp ranks (threads, one ShardClient each, real
gRPC servers) trains as the plain GPT does and loads each rank's part of a whole state dict,
float64 within 1e-9 per tensor (tests/numerics.py). Its layers one by one against their twins:
tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from numerics import assert_equivalent
from torch import nn

from paramshard.models.gpt import GPT, GPTConfig, lm_loss
from paramshard.strategies import ShardingConfiguration, TensorParallelModel
from paramshard.strategies.tensor.layers import part_ranges

equivalence = pytest.mark.equivalence


@equivalence
@pytest.mark.parametrize("tp_size", [2, 3])
def test_tensor_parallel_model_trains_like_the_plain_gpt(servers, run_ranks, tp_size):
    """Whole-GPT training with AdamW and clipping by the global norm (sharded parameters'
    squares summed over the group, replicated ones and the tied embedding once) equals plain
    training: losses, norms and the gathered state dict. tp=3: 4 heads as 2 + 1 + 1, 128 MLP
    features as 43 + 43 + 42."""
    torch.manual_seed(9)
    config = GPTConfig.tiny(vocab_size=50, bias=tp_size == 3, n_head=4, n_embd=32)
    plain = GPT(config).double()
    init = copy.deepcopy(plain.state_dict())
    data = torch.randint(50, (5, 4, 17), generator=torch.Generator().manual_seed(3))
    max_norm = 0.3

    def train(model, clip):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses, norms = [], []
        for batch in data:
            loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
            norms.append(float(clip(max_norm)))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, norms

    def rank_fn(client):
        net = GPT(config).double()
        net.load_state_dict(init)
        model = TensorParallelModel(net, ShardingConfiguration(client, job="tpm"))
        assert model.tensor_parallel_size == tp_size
        local = sum(len(r) for r in part_ranges(4 * config.n_embd, tp_size, client.rank))
        assert model.module.blocks[0].mlp.c_fc.weight.shape[0] == local
        losses, norms = train(model, model.clip_grad_norm_)
        return losses, norms, model.state_dict()

    ref_losses, ref_norms = train(plain, lambda m: nn.utils.clip_grad_norm_(plain.parameters(), m))
    assert min(ref_norms) > max_norm  # every step clips
    addresses = [s.address for s in servers(2)]
    for losses, norms, state in run_ranks(rank_fn, tp_size, addresses):
        assert_equivalent(losses, ref_losses, "losses")
        assert_equivalent(norms, ref_norms, "clipped norms")
        assert list(state) == list(plain.state_dict())
        assert_equivalent(state, plain.state_dict(), "state")


@equivalence
def test_tensor_parallel_model_load_state_dict_takes_each_rank_part(servers, run_ranks):
    torch.manual_seed(10)
    config = GPTConfig.tiny(vocab_size=50)
    source, target = GPT(config).double().state_dict(), GPT(config).double()
    idx = torch.randint(50, (2, 9))
    want = GPT(config).double()
    want.load_state_dict(source)

    def rank_fn(client):
        model = TensorParallelModel(copy.deepcopy(target), ShardingConfiguration(client, job="x"))
        model.load_state_dict(source)
        c_attn = model.module.blocks[1].attn.c_attn.weight.detach()
        with pytest.raises(RuntimeError, match="missing keys"):
            model.load_state_dict({k: v for k, v in source.items() if k != "wte.weight"})
        return c_attn, model.state_dict(), model(idx).detach()

    addresses = [s.address for s in servers(2)]
    for rank, (c_attn, state, logits) in enumerate(run_ranks(rank_fn, 2, addresses)):
        q, k, v = source["blocks.1.attn.c_attn.weight"].chunk(3)
        assert torch.equal(c_attn, torch.cat([t.chunk(2)[rank] for t in (q, k, v)]))
        for name, value in source.items():
            assert torch.equal(state[name], value), name
        assert_equivalent(logits, want(idx).detach(), f"rank {rank} logits")
