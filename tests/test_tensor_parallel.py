"""Tensor parallelism (Megatron-LM, arXiv 1909.08053) against plain PyTorch twins.

Every parallel layer runs on tp ranks (threads, one ShardClient each, real gRPC servers) and is
compared with its plain torch twin on the same weights and inputs: forward output, input
gradient and (gathered) weight gradients, all float64, within 1e-9 per tensor
(tests/numerics.py). tp = 3 splits widths that do not divide (the slice rule, whole heads).
Models of other families and plans of users' own: tests/test_tensor_plan.py.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from numerics import assert_equivalent
from torch import nn

from paramshard.models.gpt import GPT, MLP, CausalSelfAttention, GPTConfig, lm_loss
from paramshard.strategies.tensor import (
    ColumnParallelLinear,
    ColwiseParallel,
    RowParallelLinear,
    RowwiseParallel,
    gather_tensor_parallel_grads,
    gather_tensor_parallel_state,
    parallelize_module,
    tensor_parallel_part,
    tensor_parallel_splits,
)
from paramshard.strategies.tensor.communications import (
    copy_to_tensor_parallel,
    reduce_from_tensor_parallel,
)
from paramshard.strategies.tensor.layers import part_ranges
from paramshard.strategies.topology import Topology

TP_SIZES = [1, 2, 3]
F64 = torch.float64
equivalence = pytest.mark.equivalence
ATTN_PLAN = {"c_attn": ColwiseParallel(packed=3), "c_proj": RowwiseParallel()}
MLP_PLAN = {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}


@pytest.fixture
def run_tp(servers, run_ranks, one_torch_thread):
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


def _part(t, dim, ranges):
    return torch.cat([t.narrow(dim, r.start, len(r)) for r in ranges], dim)


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
def _conv1d(inp, out):
    transformers = pytest.importorskip("transformers")
    return transformers.pytorch_utils.Conv1D(out, inp)


@equivalence
@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("gather_output", [False, True])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_column_parallel_linear_matches_its_twin(run_tp, tp_size, gather_output, layout):
    # 10 outputs: 4/3/3 at tp=3. Conv1D (GPT-2) keeps its [in, out] weight, split along dim 1.
    torch.manual_seed(0)
    plain = (nn.Linear(8, 10) if layout == "linear" else _conv1d(8, 10)).double()
    w_dim = 0 if layout == "linear" else 1
    x = torch.randn(3, 5, 8, dtype=F64)
    out_grad = torch.randn(3, 5, 10, dtype=F64)  # a fixed weighting makes every grad differ

    def rank_fn(tp):
        layer = ColumnParallelLinear.from_linear(plain, tp, gather_output=gather_output)
        xr = x.clone().requires_grad_()
        y = layer(xr)
        mine = out_grad if gather_output else _part(out_grad, -1, layer.ranges())
        (y * mine).sum().backward()
        full = gather_tensor_parallel_grads(layer, tp)
        return y.detach(), xr.grad, layer.weight.grad, layer.ranges(), full

    xp = x.clone().requires_grad_()
    yp = plain(xp)
    (yp * out_grad).sum().backward()
    for y, x_grad, w_grad, ranges, full in run_tp(tp_size, rank_fn):
        _close(y, yp if gather_output else _part(yp, -1, ranges), "output")
        _close(x_grad, xp.grad, "input grad")
        _close(w_grad, _part(plain.weight.grad, w_dim, ranges), "weight grad part")
        _close(full["weight"], plain.weight.grad, "weight grad")
        _close(full["bias"], plain.bias.grad, "bias grad")


@equivalence
@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("input_is_parallel", [True, False])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_row_parallel_linear_matches_its_twin(run_tp, tp_size, input_is_parallel, layout):
    torch.manual_seed(1)
    plain = (nn.Linear(11, 6) if layout == "linear" else _conv1d(11, 6)).double()
    w_dim = 1 if layout == "linear" else 0
    x = torch.randn(3, 5, 11, dtype=F64)
    out_grad = torch.randn(3, 5, 6, dtype=F64)

    def rank_fn(tp):
        layer = RowParallelLinear.from_linear(plain, tp, input_is_parallel=input_is_parallel)
        xr = _part(x, -1, layer.ranges()) if input_is_parallel else x
        xr = xr.clone().requires_grad_()
        y = layer(xr)
        (y * out_grad).sum().backward()
        full = gather_tensor_parallel_grads(layer, tp)
        return y.detach(), xr.grad, layer.weight.grad, layer.ranges(), full

    xp = x.clone().requires_grad_()
    yp = plain(xp)
    (yp * out_grad).sum().backward()
    for y, x_grad, w_grad, ranges, full in run_tp(tp_size, rank_fn):
        _close(y, yp, "output")
        _close(x_grad, _part(xp.grad, -1, ranges) if input_is_parallel else xp.grad, "input grad")
        _close(w_grad, _part(plain.weight.grad, w_dim, ranges), "weight grad part")
        _close(full["weight"], plain.weight.grad, "weight grad")
        _close(full["bias"], plain.bias.grad, "bias grad")


# -- the example GPT's modules, split by its plan ----------------------------------------------
def _module_twin_test(run_tp, tp_size, plain, plan):
    torch.manual_seed(2)
    plain = plain.double()
    x = torch.randn(2, 8, plain.c_proj.out_features, dtype=F64)
    out_grad = torch.randn_like(x)

    def rank_fn(tp):
        module = parallelize_module(copy.deepcopy(plain), tp, plan)
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
def test_attention_split_by_heads_matches_causal_self_attention(run_tp, tp_size):
    # 4 heads: 2 + 2 at tp=2, 2 + 1 + 1 at tp=3, each rank's heads from each of q, k and v
    torch.manual_seed(3)
    attn = CausalSelfAttention(GPTConfig.tiny(n_head=4, n_embd=32))
    _module_twin_test(run_tp, tp_size, attn, ATTN_PLAN)


@equivalence
@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_mlp_split_by_columns_and_rows_matches_mlp(run_tp, tp_size):
    torch.manual_seed(4)  # 128 hidden features: 43 + 43 + 42 at tp=3
    _module_twin_test(run_tp, tp_size, MLP(GPTConfig.tiny(n_embd=32)), MLP_PLAN)


def test_attention_takes_its_heads_from_each_of_q_k_v():
    torch.manual_seed(5)
    attn = CausalSelfAttention(GPTConfig.tiny(n_head=4, n_embd=8))
    w = attn.c_attn.weight.detach()  # rows: q 0..7 | k 8..15 | v 16..23, 2 per head

    def split(rank, tp):
        return parallelize_module(
            copy.deepcopy(attn), SimpleNamespace(rank=rank, world_size=tp), ATTN_PLAN
        )

    rank1 = split(1, 2)
    assert rank1.n_head == 2
    assert torch.equal(rank1.c_attn.weight.detach(), torch.cat([w[4:8], w[12:16], w[20:24]]))
    assert torch.equal(rank1.c_proj.weight.detach(), attn.c_proj.weight.detach()[:, 4:8])
    # uneven: heads 2 + 1 + 1 over three ranks, whole heads only
    rank0 = split(0, 3)
    assert rank0.n_head == 2
    assert torch.equal(rank0.c_attn.weight.detach(), torch.cat([w[0:4], w[8:12], w[16:20]]))
    rank2 = split(2, 3)
    assert rank2.n_head == 1
    assert torch.equal(rank2.c_proj.weight.detach(), attn.c_proj.weight.detach()[:, 6:8])


# -- the whole GPT -----------------------------------------------------------------------------
@equivalence
@pytest.mark.parametrize("tp_size", [2, 3])
def test_gpt_with_its_default_plan_matches_plain_gpt(run_tp, tp_size):
    torch.manual_seed(6)
    config = GPTConfig.tiny(n_head=4, n_embd=32)
    plain = GPT(config).double()
    idx = torch.randint(config.vocab_size, (3, config.block_size))
    targets = torch.randint(config.vocab_size, (3, config.block_size))
    reference_state = {k: v.clone() for k, v in plain.state_dict().items()}

    def rank_fn(tp):
        model = parallelize_module(copy.deepcopy(plain), tp)  # no plan: the example GPT's
        assert isinstance(model.blocks[0].attn.c_attn, ColumnParallelLinear)
        assert isinstance(model.blocks[1].mlp.c_proj, RowParallelLinear)
        logits = model(idx)
        lm_loss(logits, targets).backward()
        state = gather_tensor_parallel_state(model, tp)
        return logits.detach(), gather_tensor_parallel_grads(model, tp), state

    logits_p = plain(idx)
    lm_loss(logits_p, targets).backward()
    grads_p = _plain_grads(plain)
    for logits, grads, state in run_tp(tp_size, rank_fn):
        _close(logits, logits_p, "logits")
        assert grads.keys() == grads_p.keys()
        _close(grads, grads_p, "grads")
        # the round trip: split and gathered again, bit for bit, under the original names
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
        model = parallelize_module(copy.deepcopy(plain), tp)
        logits = model(idx)
        forward = len(calls)
        logits.sum().backward()
        return forward, len(calls) - forward

    for forward, backward in run_tp(2, rank_fn):
        assert (forward, backward) == (2 * config.n_layer, 2 * config.n_layer)


def test_at_size_one_the_parameters_are_the_models_own():
    torch.manual_seed(8)
    model = GPT(GPTConfig.tiny())
    params = dict(model.named_parameters())
    idx = torch.randint(128, (2, 8))
    before = model(idx)
    parallelize_module(model, SimpleNamespace(rank=0, world_size=1))
    assert isinstance(model.blocks[0].attn.c_attn, ColumnParallelLinear)
    assert all(p is params[n] for n, p in model.named_parameters())  # ties and optimizers hold
    assert torch.equal(model(idx), before)
    assert tensor_parallel_splits(model, SimpleNamespace(rank=0, world_size=1)) == {}
    with pytest.raises(ValueError, match=r"'blocks.0.attn.c_attn' is already tensor-parallel"):
        parallelize_module(model, SimpleNamespace(rank=0, world_size=1))


def test_parts_and_their_records():
    whole = torch.arange(24.0).view(12, 2)  # q|k|v of 4 rows each, 2 heads of 2 rows
    assert torch.equal(tensor_parallel_part(whole, 0, 2, 1, 3), whole[[2, 3, 6, 7, 10, 11]])
    # the slice rule in whole units: 3 heads of 2 over 2 ranks -> 2 heads, 1 head
    assert part_ranges(6, 2, 0, unit=2) == [range(0, 4)]
    assert part_ranges(6, 2, 1, unit=2) == [range(4, 6)]
    assert part_ranges(10, 3, 0) == [range(0, 4)] and part_ranges(10, 3, 2) == [range(7, 10)]
    model = parallelize_module(GPT(GPTConfig.tiny()), SimpleNamespace(rank=1, world_size=2))
    splits = tensor_parallel_splits(model, SimpleNamespace(rank=1, world_size=2))
    assert splits["blocks.0.attn.c_attn.weight"] == {
        "split_dim": 0,
        "split_parts": 2,
        "split_index": 1,
        "split_packed": 3,
        "split_unit": 32,  # a head of the tiny GPT (64 wide, 2 heads)
    }
    assert splits["blocks.0.mlp.c_proj.weight"]["split_dim"] == 1
    assert "blocks.0.mlp.c_proj.bias" not in splits and "wte.weight" not in splits


# -- errors ------------------------------------------------------------------------------------
def test_sizes_that_cannot_be_split_are_named():
    tp3 = SimpleNamespace(rank=0, world_size=3)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear \(10\) do not split into 3 packed"):
        ColumnParallelLinear.from_linear(nn.Linear(4, 10), tp3, packed=3)
    with pytest.raises(
        ValueError, match=r"RowParallelLinear: 2 unit\(s\) of 1 per block cannot be split over"
    ):
        RowParallelLinear.from_linear(nn.Linear(2, 4), tp3)
    with pytest.raises(ValueError, match=r"^attn: 2 head\(s\) cannot be split over .*size=3"):
        parallelize_module(
            nn.ModuleDict({"attn": CausalSelfAttention(GPTConfig.tiny(n_head=2, n_embd=8))}),
            tp3,
            {"attn.c_attn": ColwiseParallel(packed=3), "attn.c_proj": RowwiseParallel()},
        )
    with pytest.raises(
        ValueError, match=r"'attn.c_attn': 24 features .* ColwiseParallel\(packed=3\)"
    ):
        parallelize_module(
            nn.ModuleDict({"attn": CausalSelfAttention(GPTConfig.tiny(n_head=2, n_embd=8))}),
            SimpleNamespace(rank=0, world_size=2),
            {"attn.c_attn": ColwiseParallel()},  # q|k|v split as if one matrix: refused
        )
    with pytest.raises(ValueError, match=r"'ln_f': .* split nn.Linear or .*Conv1D, not LayerNorm"):
        parallelize_module(GPT(GPTConfig.tiny()), tp3, {"ln_f": RowwiseParallel()})


def test_standalone_layers_hold_only_their_part():
    group = SimpleNamespace(rank=1, world_size=4)
    column = ColumnParallelLinear(6, 8, group)
    row = RowParallelLinear(8, 6, group, bias=False)
    assert column.weight.shape == (2, 6) and column.bias.shape == (2,)
    assert row.weight.shape == (6, 2) and row.bias is None
    uneven = ColumnParallelLinear(6, 10, SimpleNamespace(rank=0, world_size=3), layout="conv1d")
    assert uneven.weight.shape == (6, 4) and uneven.ranges() == [range(0, 4)]
