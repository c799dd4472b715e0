"""AiDotNet's surface (ShardedModelBase / FSDPOptimizer) on every strategy, against plain torch:
properties, flat parameter vectors, gradients, state dicts, serialization, prediction, copies.

The world (two thread ranks, two in-process servers, float64 against single-process training
within 1e-9) is tests/strategy_world.py; training through the surface is
tests/test_strategy_training.py, mixed precision tests/test_mixed_precision.py.
"""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
import torch
from numerics import assert_equivalent
from strategy_world import (
    CFG,
    KINDS,
    W,
    addrs_fixture,  # noqa: F401 - the module's servers: ``addrs``
    init_state,
    names_both_lengths,
    rank_data,
    reference,
    steps_of,
    vec,
    world,
)

from paramshard.models.gpt import GPT, lm_loss
from paramshard.protos import slicing
from paramshard.strategies import (
    ShardedModelBase,
)

pytestmark = pytest.mark.timeout(120)

# -- properties, flat vectors ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_properties_and_parameter_vectors(kind: str, run_ranks: Any, addrs: list[str]) -> None:
    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        n = sum(p.numel() for p in ref.parameters() if p.requires_grad)
        assert ref.num_params() == n  # tied weight once
        assert (model.rank, model.world_size) == (client.rank, W)
        assert model.parameter_count == n
        start, stop = slicing.slice_bounds(n, W, client.rank)
        assert (model.shard_start_index, model.shard_size) == (start, stop - start)
        assert model.wrapped_model is model.module
        assert isinstance(model.wrapped_model, GPT)

        full = model.gather_full_parameters()
        assert torch.equal(full, vec(ref))
        assert model.gather_full_parameters() is full  # cached
        assert torch.equal(model.local_parameter_shard, model.get_parameters()[start:stop])
        client.barrier()  # every rank has read the servers before any rank writes

        # round trip
        new = full + 0.01 * torch.arange(n, dtype=full.dtype) / n
        model.set_parameters(new)
        client.barrier()
        assert torch.equal(model.get_parameters(), new)
        assert torch.equal(model.local_parameter_shard, new[start:stop])
        with pytest.raises(ValueError) as info:
            model.set_parameters(torch.zeros(n + 3))
        assert names_both_lengths(str(info.value), n, n + 3), str(info.value)
        assert torch.equal(model.get_parameters(), new)
        client.barrier()

        # the cache is dropped by a step
        cached = model.gather_full_parameters()
        x, y = rank_data(client.rank)
        model.train_on_batch(x, y)
        after = model.gather_full_parameters()
        assert after is not cached
        assert not torch.equal(after, new)

    world(run_ranks, addrs, kind, fn)


# -- gradients ---------------------------------------------------------------------------------


@pytest.mark.equivalence
@pytest.mark.parametrize("kind", KINDS)
def test_compute_gradients_is_local_and_side_effect_free(
    kind: str, run_ranks: Any, addrs: list[str]
) -> None:
    init = init_state()
    want_after_step = reference(init, 1)

    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        x, y = rank_data(client.rank)
        lm_loss(ref(x), y).backward()
        want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        before, steps = model.get_parameters(), steps_of(model)
        got = model.compute_gradients(x, y)
        assert got.shape == want.shape
        assert_equivalent(got, want, "local gradients")
        assert torch.equal(model.get_parameters(), before)
        assert steps_of(model) == steps
        assert all(p.grad is None for p in model.parameters())
        client.barrier()
        # servers untouched: a normal step still matches single-process training
        model.train_on_batch(x, y)
        assert_equivalent(model.get_parameters(), want_after_step, "after one step")

    world(run_ranks, addrs, kind, fn, init=init)


@pytest.mark.equivalence
@pytest.mark.parametrize("kind", KINDS)
def test_apply_gradients_is_sgd(kind: str, run_ranks: Any, addrs: list[str]) -> None:
    g = torch.randn(
        sum(p.numel() for p in GPT(CFG).parameters()),
        generator=torch.Generator().manual_seed(7),
        dtype=torch.float64,
    )

    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        theta = model.get_parameters()
        client.barrier()
        model.apply_gradients(g, 0.05)
        client.barrier()
        assert_equivalent(model.get_parameters(), theta - 0.05 * g, "theta - lr g")
        client.barrier()

    world(run_ranks, addrs, kind, fn)


# -- state dicts, serialisation --------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip(kind: str, run_ranks: Any, addrs: list[str]) -> None:
    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        want_sd = ref.state_dict()
        sd = model.state_dict()
        assert list(sd) == list(want_sd)
        assert {"wte.weight", "lm_head.weight"} <= set(sd)
        for k, v in want_sd.items():
            assert sd[k].shape == v.shape, k
            assert torch.equal(sd[k], v), k
        client.barrier()
        modified = {k: v + 0.25 for k, v in sd.items()}
        model.load_state_dict(modified)
        client.barrier()
        back = model.state_dict()
        for k, v in modified.items():
            assert torch.equal(back[k], v), k
        # the flat vector follows (cache dropped)
        ref.load_state_dict(modified)
        assert torch.equal(model.get_parameters(), vec(ref))
        client.barrier()

    world(run_ranks, addrs, kind, fn)


@pytest.mark.parametrize("kind", KINDS)
def test_serialization_round_trips(
    kind: str, run_ranks: Any, addrs: list[str], tmp_path: Any
) -> None:
    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        r = client.rank
        original = model.get_parameters()
        data = model.serialize()
        assert isinstance(data, bytes)
        client.barrier()
        model.set_parameters(original * 2)
        client.barrier()
        model.deserialize(data)
        client.barrier()
        assert torch.equal(model.get_parameters(), original)

        path = tmp_path / f"model-{r}.safetensors"
        model.save_model(path)
        client.barrier()
        model.set_parameters(original * 3)
        client.barrier()
        model.load_model(path)
        client.barrier()
        assert torch.equal(model.get_parameters(), original)

        with pytest.raises(FileNotFoundError):
            model.load_model(tmp_path / f"missing-{r}.bin")
        bad = tmp_path / f"corrupt-{r}.bin"
        bad.write_bytes(b"\x00garbage" * 10)
        with pytest.raises(ValueError, match=re.escape(str(bad))):
            model.load_model(bad)
        with pytest.raises(ValueError):
            model.deserialize(b"not a model")
        assert torch.equal(model.get_parameters(), original)

        buf = io.BytesIO()
        model.save_state(buf)
        client.barrier()
        model.set_parameters(original - 1)
        client.barrier()
        buf.seek(0)
        model.load_state(buf)
        client.barrier()
        assert torch.equal(model.get_parameters(), original)
        client.barrier()

    world(run_ranks, addrs, kind, fn)


# -- copies, metadata, prediction ----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_predict_and_metadata(kind: str, run_ranks: Any, addrs: list[str]) -> None:
    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        x, _ = rank_data(client.rank)
        with torch.no_grad():
            want_out = ref(x)
        torch.testing.assert_close(model.predict(x), want_out, rtol=0, atol=0)
        meta = model.get_model_metadata()
        assert meta["strategy"] == kind
        assert meta["parameter_count"] == model.parameter_count == vec(ref).numel()
        assert meta["world_size"] == W
        client.barrier()

    world(run_ranks, addrs, kind, fn)


@pytest.mark.parametrize("kind", KINDS)
def test_with_parameters_and_deep_copy(kind: str, run_ranks: Any, addrs: list[str]) -> None:
    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        x, _ = rank_data(client.rank)
        theta = model.get_parameters()
        with torch.no_grad():
            want_out = ref(x)
        try:
            other = theta + 0.5
            copy_ = model.with_parameters(other)
            assert isinstance(copy_, GPT) and not isinstance(copy_, ShardedModelBase)
            assert copy_ is not model.module
            assert torch.equal(vec(copy_), other)
            assert copy_.lm_head.weight is copy_.wte.weight  # still tied
            assert torch.equal(model.get_parameters(), theta)

            dc = model.deep_copy()
            assert isinstance(dc, GPT) and dc is not model.module
            assert torch.equal(vec(dc), theta)
            with torch.no_grad():
                torch.testing.assert_close(dc(x), want_out, rtol=0, atol=0)
                for p in dc.parameters():  # the copy is independent of the wrapper
                    p.add_(1.0)
            assert torch.equal(model.get_parameters(), theta)
            torch.testing.assert_close(model.predict(x), want_out, rtol=0, atol=0)
        finally:
            client.barrier()

    world(run_ranks, addrs, kind, fn)
