"""Tensor parallelism (Megatron-LM, arXiv 1909.08053) against plain PyTorch twins.

Every parallel layer runs on tp ranks (threads, one ShardClient each, real gRPC servers) and is
compared with its plain torch twin on the same weights and inputs: forward output, input
gradient and (gathered) weight gradients, all float64, within 1e-9 per tensor
(tests/numerics.py).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from numerics import assert_equivalent
from torch import nn

from examples.gpt import GPT, MLP, CausalSelfAttention, GPTConfig, lm_loss
from strategies import ShardingConfiguration, TensorParallelModel
from strategies.tensor_parallel import (
    ColumnParallelLinear,
    ParallelCausalSelfAttention,
    ParallelMLP,
    RowParallelLinear,
    copy_to_tensor_parallel,
    gather_tensor_parallel_grads,
    gather_tensor_parallel_state,
    parallelize_gpt_blocks,
    reduce_from_tensor_parallel,
)
from strategies.topology import Topology

TP_SIZES = [1, 2]
F64 = torch.float64
equivalence = pytest.mark.equivalence


@pytest.fixture
def run_tp(servers, run_ranks):
    """``run_tp(tp, fn)``: ``fn(tp_client)`` on ranks 0..tp-1 of a pure tensor-parallel world."""
    addresses = [s.address for s in servers(2)]

    def run(tp, fn):
        topo = Topology(tp, 1, tp, 1)
        return run_ranks(lambda client: fn(topo.group_clients(client).tp), tp, addresses)

    return run


def _close(actual, expected, what="value"):
    assert_equivalent(actual, expected, what)


def _plain_grads(module):
    return {name: p.grad.clone() for name, p in module.named_parameters()}


# -- f and g -----------------------------------------------------------------------------------
def test_f_is_identity_forward_and_all_reduce_backward(run_tp):
    def rank_fn(tp):
        x = torch.arange(4.0, requires_grad=True)
        y = copy_to_tensor_parallel(x, tp)
        (y * (tp.rank + 1)).sum().backward()
        return y.detach(), x.grad

    for y, grad in run_tp(2, rank_fn):
        assert torch.equal(y, torch.arange(4.0))
        assert torch.equal(grad, torch.full((4,), 3.0))  # 1 + 2: both ranks' contributions


def test_g_is_all_reduce_forward_and_identity_backward(run_tp):
    def rank_fn(tp):
        x = torch.full((3,), float(tp.rank + 1), requires_grad=True)
        y = reduce_from_tensor_parallel(x, tp)
        (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        return y.detach(), x.grad

    for y, grad in run_tp(2, rank_fn):
        assert torch.equal(y, torch.full((3,), 3.0))
        assert torch.equal(grad, torch.tensor([1.0, 2.0, 3.0]))


# -- linear layers -----------------------------------------------------------------------------
@equivalence
@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_linear_matches_nn_linear(run_tp, tp_size, gather_output):
    torch.manual_seed(0)
    linear = nn.Linear(8, 12).double()
    x = torch.randn(3, 5, 8, dtype=F64)
    out_grad = torch.randn(3, 5, 12, dtype=F64)  # a fixed weighting makes every grad differ

    def rank_fn(tp):
        layer = ColumnParallelLinear.from_linear(linear, tp, gather_output=gather_output)
        xr = x.clone().requires_grad_()
        y = layer(xr)
        mine = out_grad if gather_output else out_grad.chunk(tp.world_size, -1)[tp.rank]
        (y * mine).sum().backward()
        full = gather_tensor_parallel_grads(layer, tp)
        return y.detach(), xr.grad, layer.weight.grad, full

    xp = x.clone().requires_grad_()
    yp = linear(xp)
    (yp * out_grad).sum().backward()
    for rank, (y, x_grad, w_grad, full) in enumerate(run_tp(tp_size, rank_fn)):
        _close(y, yp if gather_output else yp.chunk(tp_size, -1)[rank], "output")
        _close(x_grad, xp.grad, "input grad")
        _close(w_grad, linear.weight.grad.chunk(tp_size, 0)[rank], "weight grad part")
        _close(full["weight"], linear.weight.grad, "weight grad")
        _close(full["bias"], linear.bias.grad, "bias grad")


@equivalence
@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_matches_nn_linear(run_tp, tp_size, input_is_parallel):
    torch.manual_seed(1)
    linear = nn.Linear(12, 6).double()
    x = torch.randn(3, 5, 12, dtype=F64)
    out_grad = torch.randn(3, 5, 6, dtype=F64)

    def rank_fn(tp):
        layer = RowParallelLinear.from_linear(linear, tp, input_is_parallel=input_is_parallel)
        xr = x.chunk(tp.world_size, -1)[tp.rank] if input_is_parallel else x
        xr = xr.clone().requires_grad_()
        y = layer(xr)
        (y * out_grad).sum().backward()
        full = gather_tensor_parallel_grads(layer, tp)
        return y.detach(), xr.grad, layer.weight.grad, full

    xp = x.clone().requires_grad_()
    yp = linear(xp)
    (yp * out_grad).sum().backward()
    for rank, (y, x_grad, w_grad, full) in enumerate(run_tp(tp_size, rank_fn)):
        _close(y, yp, "output")
        _close(
            x_grad, xp.grad.chunk(tp_size, -1)[rank] if input_is_parallel else xp.grad, "input grad"
        )
        _close(w_grad, linear.weight.grad.chunk(tp_size, 1)[rank], "weight grad part")
        _close(full["weight"], linear.weight.grad, "weight grad")
        _close(full["bias"], linear.bias.grad, "bias grad")


# -- GPT modules -------------------------------------------------------------------------------
def _module_twin_test(run_tp, tp_size, plain, parallel_cls):
    torch.manual_seed(2)
    plain = plain.double()
    x = torch.randn(2, 8, plain.c_proj.out_features, dtype=F64)
    out_grad = torch.randn_like(x)

    def rank_fn(tp):
        module = parallel_cls.from_module(plain, tp)
        xr = x.clone().requires_grad_()
        y = module(xr)
        (y * out_grad).sum().backward()
        return y.detach(), xr.grad, gather_tensor_parallel_grads(module, tp)

    xp = x.clone().requires_grad_()
    yp = plain(xp)
    (yp * out_grad).sum().backward()
    for y, x_grad, grads in run_tp(tp_size, rank_fn):
        _close(y, yp, "output")
        _close(x_grad, xp.grad, "input grad")
        assert grads.keys() == _plain_grads(plain).keys()
        _close(grads, _plain_grads(plain), "grads")


@equivalence
@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_parallel_attention_matches_causal_self_attention(run_tp, tp_size):
    # 4 heads: with tp=2 each rank takes two heads from each of q, k and v
    torch.manual_seed(3)
    attn = CausalSelfAttention(GPTConfig.tiny(n_head=4, n_embd=32))
    _module_twin_test(run_tp, tp_size, attn, ParallelCausalSelfAttention)


@equivalence
@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_parallel_mlp_matches_mlp(run_tp, tp_size):
    torch.manual_seed(4)
    _module_twin_test(run_tp, tp_size, MLP(GPTConfig.tiny(n_embd=32)), ParallelMLP)


def test_attention_takes_its_heads_from_each_of_q_k_v():
    torch.manual_seed(5)
    attn = CausalSelfAttention(GPTConfig.tiny(n_head=4, n_embd=8))
    w = attn.c_attn.weight.detach()  # rows: q 0..7 | k 8..15 | v 16..23
    rank1 = ParallelCausalSelfAttention.from_module(attn, SimpleNamespace(rank=1, world_size=2))
    assert rank1.n_head == 2
    expected = torch.cat([w[4:8], w[12:16], w[20:24]])
    assert torch.equal(rank1.c_attn.weight.detach(), expected)
    assert torch.equal(rank1.c_proj.weight.detach(), attn.c_proj.weight.detach()[:, 4:8])


# -- the whole GPT -----------------------------------------------------------------------------
@equivalence
def test_gpt_with_parallel_blocks_matches_plain_gpt(run_tp):
    torch.manual_seed(6)
    config = GPTConfig.tiny()
    plain = GPT(config).double()
    idx = torch.randint(config.vocab_size, (3, config.block_size))
    targets = torch.randint(config.vocab_size, (3, config.block_size))
    reference_state = {k: v.clone() for k, v in plain.state_dict().items()}

    def rank_fn(tp):
        model = parallelize_gpt_blocks(copy.deepcopy(plain), tp)
        assert isinstance(model.blocks[0].attn, ParallelCausalSelfAttention)
        assert isinstance(model.blocks[1].mlp, ParallelMLP)
        logits = model(idx)
        lm_loss(logits, targets).backward()
        state = gather_tensor_parallel_state(model, tp)
        return logits.detach(), gather_tensor_parallel_grads(model, tp), state

    logits_p = plain(idx)
    lm_loss(logits_p, targets).backward()
    grads_p = _plain_grads(plain)
    for logits, grads, state in run_tp(2, rank_fn):
        _close(logits, logits_p, "logits")
        assert grads.keys() == grads_p.keys()
        _close(grads, grads_p, "grads")
        # the round trip: sharded and gathered again, bit for bit, under the original names
        assert list(state) == list(reference_state)
        for name, value in reference_state.items():
            assert torch.equal(state[name], value), name


def test_each_block_costs_two_all_reduces_forward_and_two_backward(run_tp):
    torch.manual_seed(7)
    config = GPTConfig.tiny(n_layer=3)
    plain = GPT(config)
    idx = torch.randint(config.vocab_size, (2, 8))

    def rank_fn(tp):
        calls = []
        real = tp.all_reduce
        tp.all_reduce = lambda x, op="sum": calls.append(op) or real(x, op)
        model = parallelize_gpt_blocks(copy.deepcopy(plain), tp)
        logits = model(idx)
        forward = len(calls)
        logits.sum().backward()
        return forward, len(calls) - forward

    for forward, backward in run_tp(2, rank_fn):
        assert (forward, backward) == (2 * config.n_layer, 2 * config.n_layer)


def test_parallelize_accepts_a_list_of_blocks_and_refuses_twice():
    torch.manual_seed(8)
    model = GPT(GPTConfig.tiny())
    group = SimpleNamespace(rank=0, world_size=1)
    blocks = list(model.blocks)
    assert parallelize_gpt_blocks(blocks, group) is blocks
    assert isinstance(model.blocks[0].attn, ParallelCausalSelfAttention)
    with pytest.raises(ValueError, match="already tensor-parallel"):
        parallelize_gpt_blocks(model, group)


# -- errors ------------------------------------------------------------------------------------
def test_sizes_that_do_not_divide_are_named():
    tp3 = SimpleNamespace(rank=0, world_size=3)
    with pytest.raises(
        ValueError,
        match=r"ColumnParallelLinear out_features \(10\) is not divisible by the "
        r"tensor-parallel size \(3\)",
    ):
        ColumnParallelLinear(4, 10, tp3)
    with pytest.raises(ValueError, match=r"RowParallelLinear in_features \(10\) .* size \(3\)"):
        RowParallelLinear.from_linear(nn.Linear(10, 4), tp3)
    with pytest.raises(ValueError, match=r"n_head \(4\) is not divisible .* size \(3\)"):
        ParallelCausalSelfAttention.from_module(
            CausalSelfAttention(GPTConfig.tiny(n_head=4, n_embd=12)), tp3
        )
    with pytest.raises(ValueError, match=r"out_features \(10\) do not split into 3 blocks"):
        ColumnParallelLinear.from_linear(nn.Linear(4, 10), tp3, num_packed=3)
    with pytest.raises(ValueError, match=r"packed block \(4\) is not divisible .* size \(3\)"):
        ColumnParallelLinear.from_linear(nn.Linear(4, 12), tp3, num_packed=3)


def test_standalone_layers_hold_only_their_shard():
    group = SimpleNamespace(rank=1, world_size=4)
    column = ColumnParallelLinear(6, 8, group)
    row = RowParallelLinear(8, 6, group, bias=False)
    assert column.weight.shape == (2, 6) and column.bias.shape == (2,)
    assert row.weight.shape == (6, 2) and row.bias is None


# -- TensorParallelModel -----------------------------------------------------------------------
@equivalence
def test_tensor_parallel_model_trains_like_the_plain_gpt(servers, run_ranks):
    """Whole-GPT training at tp=2 with AdamW and clipping by the global norm (sharded
    parameters' squares summed over the group, replicated ones and the tied embedding once)
    equals plain training: losses, norms and the gathered state dict."""
    torch.manual_seed(9)
    config = GPTConfig.tiny(vocab_size=50, bias=False)
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
        assert model.tensor_parallel_size == 2
        assert model.module.blocks[0].mlp.c_fc.weight.shape[0] == 2 * config.n_embd  # half
        losses, norms = train(model, model.clip_grad_norm_)
        return losses, norms, model.state_dict()

    ref_losses, ref_norms = train(plain, lambda m: nn.utils.clip_grad_norm_(plain.parameters(), m))
    assert min(ref_norms) > max_norm  # every step clips
    addresses = [s.address for s in servers(2)]
    for losses, norms, state in run_ranks(rank_fn, 2, addresses):
        _close(losses, ref_losses, "losses")
        _close(norms, ref_norms, "clipped norms")
        assert list(state) == list(plain.state_dict())
        _close(state, plain.state_dict(), "state")


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
        _close(logits, want(idx).detach(), f"rank {rank} logits")
