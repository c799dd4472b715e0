"""A 3D-parallel job's whole-model state in and out by parameter name: ``load_state_dict``
of a whole model into every rank's part (training then continues as a single process
would), uneven heads (3 on 2 tensor ranks) exported and loaded whole, and ``join_parts``,
which joins the tensor-parallel parts the servers hold. Helpers and the model as in
test_hybrid_export.py: ranks are threads, servers in-process, float64 end to end.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from hybrid_runs import (
    AGAIN,
    FIRST,
    assert_equal_state,
    batches,
    initial_weights,
    live_export,
    new_gpt,
    run_hybrid,
    sgd,
)
from numerics import assert_equivalent

from paramshard.client import ClusterSpec, ShardClient
from paramshard.models.gpt import GPT, GPTConfig, lm_loss
from paramshard.server import ShardServer
from paramshard.strategies import HybridShardedModel, HybridShardedOptimizer, ShardingConfiguration

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- load_state_dict --------------------------------------------------------------------------
@pytest.mark.equivalence
def test_load_state_dict_round_trip_and_training_continues():
    """SGD, not Adam: Adam's first steps turn round-off in a gradient below its eps into
    visible differences (seed 7 has one of 2e-9), which would hide nothing but flake."""
    other = initial_weights(seed=7)
    data = batches(FIRST + AGAIN)
    reference = new_gpt()
    reference.load_state_dict(other)
    opt = sgd(reference.parameters())
    ref_losses = []
    for s in range(AGAIN):
        loss = lm_loss(reference(data[s, :, :-1]), data[s, :, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())

    def body(model: Any, opt: Any, train: Any) -> Any:
        model.load_state_dict(other)
        loaded = model.state_dict()
        return loaded, [train(s) for s in range(AGAIN)], model.state_dict()

    nodes = [ShardServer().start() for _ in range(2)]
    try:
        job = f"gpt3d-{uuid.uuid4().hex[:6]}"
        results = run_hybrid(2, 2, 1, [n.address for n in nodes], job, body, sgd)
    finally:
        for n in nodes:
            n.stop(0)
    for r, (loaded, losses, state) in enumerate(results):
        assert_equal_state(loaded, other, f"rank {r} state_dict after load_state_dict")
        assert_equivalent(losses, ref_losses, f"rank {r} losses")
        assert_equivalent(state, reference.state_dict(), f"rank {r}")


# -- the join itself ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ranks,dim,packed,unit",
    [(2, 0, 1, 1), (4, 0, 3, 1), (4, 1, 1, 1), (2, 1, 2, 1), (3, 0, 1, 1), (2, 0, 3, 4)],
)
def test_join_parts_inverts_the_split(ranks, dim, packed, unit):
    """Equal parts, and uneven ones (24 rows on 3 ranks by whole units, 3 blocks of 3 heads
    of 4 on 2 ranks: 2 + 1 heads of each)."""
    from paramshard.client.tensor_parts import PartParam, join_parts
    from paramshard.protos.manifest import ParamSplit
    from paramshard.strategies.tensor import tensor_parallel_part

    rows = 36 if unit > 1 else 24
    whole = torch.randn(rows, 12) if dim == 0 else torch.randn(6, rows)
    norm = torch.randn(12)

    def part(name: str, t: int, value: torch.Tensor, split: bool) -> PartParam:
        arr = value.numpy().copy()
        cut = ParamSplit(dim, ranks, t, packed, unit) if split else None
        return PartParam(name, tuple(arr.shape), split=cut, read=lambda: arr.reshape(-1))

    parts = {
        (0, t): [
            part("w", t, tensor_parallel_part(whole, dim, ranks, t, packed, unit), True),
            part("ln", t, norm, False),
        ]
        for t in range(ranks)
    }
    parts[1, 0] = [part("head", 0, norm * 2, False)]  # a second stage, tensor ranks of its own
    for t in range(1, ranks):
        parts[1, t] = [part("head", t, norm * 2, False)]
    joined = {w.name: w for w in join_parts("m", parts)}
    assert list(joined) == ["w", "ln", "head"]
    assert joined["w"].shape == tuple(whole.shape)
    assert joined["w"].source == tuple(f"m.pp0.tp{t}" for t in range(ranks))
    np.testing.assert_array_equal(joined["w"].produce().reshape(whole.shape), whole.numpy())
    np.testing.assert_array_equal(joined["ln"].produce(), norm.numpy())


@pytest.mark.equivalence
def test_uneven_heads_export_and_load_the_whole_model(tmp_path):
    """3 heads on 2 tensor ranks (2 + 1, the slice rule by whole heads): the servers' manifests
    say where each part sits, so live export joins them into the whole model, and
    load_state_dict takes each rank's part back."""
    cfg = GPTConfig.tiny(vocab_size=50, bias=True, n_layer=2, n_head=3, n_embd=24)
    torch.manual_seed(3)
    init = GPT(cfg).double().state_dict()
    nodes = [ShardServer().start() for _ in range(2)]
    addresses, run, job = (
        [n.address for n in nodes],
        uuid.uuid4().hex[:6],
        f"uneven-{uuid.uuid4().hex[:6]}",
    )

    def rank(r: int) -> Any:
        client = ShardClient(ClusterSpec(addresses), rank=r, world_size=2, run_id=run)
        config = ShardingConfiguration(client, job=job)
        net = GPT(cfg).double()
        net.load_state_dict(init)
        model = HybridShardedModel(net, config, 1, 2, 1, micro_batch_count=2)
        HybridShardedOptimizer(sgd(model.parameters()), config)
        shapes = {n: tuple(p.shape) for n, p in model.stage.named_parameters()}
        model.load_state_dict(init)
        return shapes, model.state_dict()

    try:
        with ThreadPoolExecutor(2) as pool:
            results = [f.result(timeout=300) for f in [pool.submit(rank, r) for r in range(2)]]
        exported = live_export(addresses, job, tmp_path / "uneven.safetensors")
    finally:
        for n in nodes:
            n.stop(0)
    (shapes0, state0), (shapes1, state1) = results
    assert shapes0["blocks.0.attn.c_attn.weight"] == (3 * 16, 24)  # 2 heads of 8 in q, k, v
    assert shapes1["blocks.0.attn.c_attn.weight"] == (3 * 8, 24)  # 1 head
    for state in (state0, state1):
        assert_equal_state(state, init, "state_dict after load_state_dict")
    want = {k: v for k, v in init.items() if k != "lm_head.weight"}  # tied: one key
    for name, value in want.items():
        assert torch.equal(exported[name], value), name


def test_join_parts_refuses_parts_that_do_not_fit():
    from paramshard.client.tensor_parts import PartParam, PartsError, join_parts
    from paramshard.protos.manifest import ParamSplit

    def p(name: str, shape: tuple, t: int = 0, parts: int = 0) -> PartParam:
        cut = ParamSplit(0, parts, t) if parts > 1 else None
        return PartParam(name, shape, split=cut, read=lambda: np.zeros(shape))

    with pytest.raises(PartsError, match=r"missing m\.pp0\.tp1"):
        join_parts("m", {(0, 0): [p("w", (2, 2), 0, 2)], (1, 1): [p("v", (2,))]})
    with pytest.raises(PartsError, match="split in 3 part"):
        join_parts("m", {(0, 0): [p("w", (2, 2), 0, 3)], (0, 1): [p("w", (2, 2), 1, 3)]})
    with pytest.raises(PartsError, match="hold different parameters"):
        join_parts("m", {(0, 0): [p("w", (2, 2), 0, 2)], (0, 1): [p("v", (2, 2), 1, 2)]})
    with pytest.raises(PartsError, match="no parameter says how it is split"):
        join_parts("m", {(0, 0): [p("w", (2, 2))], (0, 1): [p("w", (2, 2))]})
    with pytest.raises(PartsError, match="held by both"):
        join_parts("m", {(0, 0): [p("w", (2,))], (1, 0): [p("w", (2,))]})
