"""AiDotNet's surface (ShardedModelBase / FSDPOptimizer) on every strategy, training:
train_on_batch, optimizers and schedulers, optimize with early stopping, gradient
accumulation, DDP's no_sync and its kept buckets, FSDP's memory bound.

The world (two thread ranks, two in-process servers, float64 against single-process training
within 1e-9) is tests/strategy_world.py; the rest of the surface is
tests/test_strategy_surface.py.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytest
import torch
from numerics import assert_equivalent
from strategy_world import (
    KINDS,
    LR,
    VOCAB,
    XV,
    YV,
    W,
    addrs_fixture,  # noqa: F401 - the module's servers: ``addrs``
    init_state,
    rank_data,
    reference,
    train_accumulated,
    world,
)

from paramshard.models.gpt import GPT, GPTConfig, lm_loss
from paramshard.strategies import (
    DDPModel,
    FSDPModel,
    OptimizationInputData,
    OptimizationResult,
    ShardedModelBase,
    ZeRO1Optimizer,
)

pytestmark = pytest.mark.timeout(120)


# -- training --------------------------------------------------------------------------------


@pytest.mark.equivalence
@pytest.mark.parametrize("kind", KINDS)
def test_train_on_batch_matches_single_process(kind: str, run_ranks: Any, addrs: list[str]) -> None:
    init = init_state()
    want = reference(init, 2)

    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> list[float]:
        x, y = rank_data(client.rank)
        losses = []
        for i in range(2):
            loss = model.train_on_batch(x, y)
            assert isinstance(loss, float)
            losses.append(loss)
            if kind != "ddp":
                assert model.step_count == i + 1
        assert_equivalent(model.get_parameters(), want, "after two steps")
        return losses

    out = world(run_ranks, addrs, kind, fn, init=init)
    assert all(len(ls) == 2 for ls in out)


@pytest.mark.parametrize("kind", KINDS)
def test_train_on_batch_without_optimizer(kind: str, run_ranks: Any, addrs: list[str]) -> None:
    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        x, y = rank_data(client.rank)
        with pytest.raises(RuntimeError, match="optimizer"):
            model.train_on_batch(x, y)

    world(run_ranks, addrs, kind, fn, with_opt=False)


# -- optimizer wrapper --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_optimizer_scheduler_and_zero_lr(kind: str, run_ranks: Any, addrs: list[str]) -> None:
    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        x, y = rank_data(client.rank)
        assert isinstance(opt, torch.optim.Optimizer)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
        lrs = []
        for _ in range(2):
            model.train_on_batch(x, y)
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        assert lrs[0] < LR and lrs[1] < lrs[0]
        assert opt.inner.param_groups[0]["lr"] == lrs[-1]
        opts = opt.get_options()
        assert opts["optimizer"] == "AdamW" and opts["strategy"] == kind
        assert opts["param_groups"][0]["lr"] == lrs[-1]
        assert opts["param_groups"][0]["weight_decay"] == 0.1

        # lr reaches the servers: lr = 0 leaves the parameters where they are
        for g in opt.param_groups:
            g["lr"] = 0.0
        before = model.get_parameters()
        model.train_on_batch(x, y)
        assert torch.equal(model.get_parameters(), before)
        for g in opt.param_groups:
            g["lr"] = LR
        model.train_on_batch(x, y)
        assert not torch.equal(model.get_parameters(), before)

        data = opt.serialize()
        opt.deserialize(data)
        assert opt.get_options()["param_groups"][0]["lr"] == LR
        with pytest.raises(ValueError):
            opt.deserialize(b"junk")

    world(run_ranks, addrs, kind, fn)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_optimize_and_early_stop(kind: str, run_ranks: Any, addrs: list[str]) -> None:
    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        x, y = rank_data(client.rank)
        result = opt.optimize(OptimizationInputData(x, y, XV, YV, epochs=3, batch_size=1))
        assert isinstance(result, OptimizationResult)
        assert len(result.loss_history) == 3 * 2  # 2 samples, batch 1
        assert all(isinstance(v, float) for v in result.loss_history)
        assert len(result.validation_loss_history) == 3 and result.epochs_run == 3
        assert result.best_loss == min(result.validation_loss_history)
        assert result.best_parameters is not None
        assert result.best_parameters.shape == (model.parameter_count,)
        if result.validation_loss_history[-1] == result.best_loss:
            assert torch.equal(result.best_parameters, model.get_parameters())
        client.barrier()

        # patience logic (pure)
        opt.patience, opt.min_delta = 2, 0.0
        opt._validation_losses = [1.0, 0.9]
        assert not opt.should_early_stop()  # not more than `patience` evaluations yet
        opt._validation_losses = [1.0, 0.9, 0.95, 0.96]
        assert opt.should_early_stop()
        opt._validation_losses = [1.0, 0.9, 0.95, 0.85]
        assert not opt.should_early_stop()
        opt.min_delta = 0.1
        assert opt.should_early_stop()  # 0.85 is not better than 0.9 by 0.1

    world(run_ranks, addrs, kind, fn)


def test_unsupported_optimizer_names_supported(run_ranks: Any, addrs: list[str]) -> None:
    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        with pytest.raises(TypeError) as info:
            ZeRO1Optimizer(torch.optim.LBFGS(model.module.parameters()), model.config)
        msg = str(info.value)
        assert "LBFGS" in msg
        for name in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop"):
            assert name in msg

    world(run_ranks, addrs, "zero1", fn, with_opt=False)


def test_unsupported_optimizer_does_not_stay_attached(run_ranks: Any, addrs: list[str]) -> None:
    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        with pytest.raises(TypeError):
            ZeRO1Optimizer(torch.optim.LBFGS(model.module.parameters()), model.config)
        x, y = rank_data(client.rank)
        with pytest.raises(RuntimeError, match="optimizer wrapper"):
            model.train_on_batch(x, y)
        assert model.optimizer is None

    world(run_ranks, addrs, "zero1", fn, with_opt=False)


def test_kernel_options_warn_that_the_servers_ignore_them(run_ranks: Any, addrs: list[str]) -> None:
    """``fused``/``foreach`` choose torch's kernels on the trainer; the servers run the update
    with their own arrays, so asking for one warns, at the line that built the wrapper, and
    torch's defaults (foreach=None) say nothing. The warnings are caught around both rank
    threads at once: a ``catch_warnings`` in each thread swaps the process's filters under
    the other's feet (rank 1's then saw no warning)."""
    lines: list[int] = []

    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        params = list(model.module.parameters())
        lines.append(sys._getframe().f_lineno + 1)
        ZeRO1Optimizer(torch.optim.AdamW(params, lr=LR, foreach=True), model.config)
        ZeRO1Optimizer(torch.optim.AdamW(params, lr=LR), model.config)

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        world(run_ranks, addrs, "zero1", fn, with_opt=False)
    ignored = [w for w in got if "is ignored" in str(w.message)]
    assert len(ignored) == W  # one a rank: foreach=True; none for the defaults
    for w in ignored:
        assert "AdamW(foreach=True) is ignored" in str(w.message)
        assert (w.filename, w.lineno) == (__file__, lines[0])


# -- FSDP memory ---------------------------------------------------------------------------------


def test_fsdp_memory_bound_and_freeing(run_ranks: Any, addrs: list[str]) -> None:
    cfg = GPTConfig.tiny(vocab_size=VOCAB, n_layer=4, bias=False)  # float32: 4 bytes a value

    def fn(client: Any, model: FSDPModel, opt: Any, ref: GPT) -> None:
        sizes: dict[str, int] = {}
        for b in model._flat_buffers:
            sizes[b.unit] = sizes.get(b.unit, 0) + b.numel * 4
        blocks = {u: s for u, s in sizes.items() if u != "root"}
        assert len(blocks) == 4
        x, y = rank_data(client.rank)
        model.train_on_batch(x, y)
        assert model.peak_live_bytes > 0
        assert model.peak_live_bytes <= sizes["root"] + 2 * max(blocks.values())
        assert model.live_bytes == 0
        for block in model.module.blocks:
            for p in block.parameters():
                assert p.numel() == 0
        model.predict(x)
        assert model.live_bytes == 0

    world(run_ranks, addrs, "fsdp", fn, cfg=cfg, init=init_state(cfg, dtype=torch.float32))


# -- gradient accumulation, no_sync ----------------------------------------------------------


@pytest.mark.equivalence
@pytest.mark.parametrize("kind", ["zero2", "fsdp"])
def test_gradient_accumulation_matches_whole_batch(
    kind: str, run_ranks: Any, addrs: list[str]
) -> None:
    init = init_state()
    want = reference(init, 2)

    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> None:
        x, y = rank_data(client.rank)
        train_accumulated(model, opt, x, y, 2)
        assert_equivalent(model.get_parameters(), want, "accumulated over 2 micro-batches")
        client.barrier()
        # one backward instead of two: the step refuses
        lm_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match="gradient_accumulation_steps"):
            opt.step()

    world(run_ranks, addrs, kind, fn, init=init, gradient_accumulation_steps=2)


@pytest.mark.equivalence
def test_ddp_no_sync_matches_whole_batch(run_ranks: Any, addrs: list[str]) -> None:
    init = init_state()
    want = reference(init, 2)

    def fn(client: Any, model: DDPModel, opt: Any, ref: GPT) -> None:
        x, y = rank_data(client.rank)
        for _ in range(2):
            with model.no_sync():
                (lm_loss(model(x[:1]), y[:1]) / 2).backward()
            (lm_loss(model(x[1:]), y[1:]) / 2).backward()
            opt.step()
            opt.zero_grad()
        assert_equivalent(model.get_parameters(), want, "no_sync")

    world(run_ranks, addrs, "ddp", fn, init=init)


@pytest.mark.equivalence
def test_ddp_buckets_kept_across_steps_and_synchronizations(
    run_ranks: Any, addrs: list[str]
) -> None:
    """Each bucket's flat buffer is made once and reused (strategies/data_parallel/ddp.py): two
    steps of backward under no_sync, then ``synchronize_gradients`` twice (the second averages
    averages, which changes nothing), match the whole batch's training."""
    init = init_state()
    want = reference(init, 2)

    def fn(client: Any, model: DDPModel, opt: Any, ref: GPT) -> None:
        x, y = rank_data(client.rank)
        for _ in range(2):
            with model.no_sync():
                lm_loss(model(x), y).backward()
            model.synchronize_gradients()
            model.synchronize_gradients()
            opt.step()
            opt.zero_grad()
        assert_equivalent(model.get_parameters(), want, "synchronized twice a step")

    world(run_ranks, addrs, "ddp", fn, init=init)


@pytest.mark.equivalence
@pytest.mark.parametrize("views", [False, True])
def test_ddp_gradients_as_bucket_views(views: bool, run_ranks: Any, addrs: list[str]) -> None:
    """``gradient_as_bucket_view`` (torch DDP's option): the averaged gradients are views of
    the buckets' flat buffers, no copy back, none held twice. Zeroed in place
    (``set_to_none=False``) they stay views and the next backward accumulates into the
    buckets (under no_sync too). Off (the default, as torch's), each gradient is its own
    tensor and one the caller kept is not touched by the next step. Either way training
    matches the whole batch's."""
    init = init_state()
    want = reference(init, 2)

    def fn(client: Any, model: DDPModel, opt: Any, ref: GPT) -> None:
        x, y = rank_data(client.rank)
        params = [p for p in model.parameters() if p.requires_grad]
        kept: list[torch.Tensor] = []
        for _ in range(2):
            with model.no_sync():
                (lm_loss(model(x[:1]), y[:1]) / 2).backward()
            (lm_loss(model(x[1:]), y[1:]) / 2).backward()
            storages = {p.grad.untyped_storage().data_ptr() for p in params}
            if views:
                assert len(storages) < len(params) / 4, (len(storages), len(params))
            else:
                assert len(storages) == len(params)
            if not kept:
                kept = [p.grad for p in params]
                first = [g.clone() for g in kept]
            opt.step()
            opt.zero_grad(set_to_none=views is False)
            if views:
                assert all(p.grad is not None and not p.grad.any() for p in params)
        unchanged = all(torch.equal(g, f) for g, f in zip(kept, first, strict=True))
        assert unchanged is not views  # a view changes with the next step's gradients
        assert_equivalent(model.get_parameters(), want, "gradients as bucket views")

    world(run_ranks, addrs, "ddp", fn, init=init, gradient_as_bucket_view=views)
