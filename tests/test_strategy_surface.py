"""AiDotNet's surface (ShardedModelBase / FSDPOptimizer) on every strategy, against plain torch.

Two ranks run in threads against two in-process shard servers; the initial state dict is built
once in the main thread (threads share torch's global RNG) and loaded into every rank's model.
Each rank trains on its half of a 4-sample batch, so the strategies must match single-process
training on the whole batch: float64 on both sides, within 1e-9 (tests/numerics.py). Mixed
precision is tested in tests/test_mixed_precision.py.
"""

from __future__ import annotations

import io
import re
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from numerics import assert_equivalent
from torch import nn

from paramshard.models.gpt import GPT, Block, GPTConfig, lm_loss
from paramshard.protos import slicing
from paramshard.server import ShardServer
from paramshard.strategies import (
    DATA_PARALLEL,
    DDPModel,
    FSDPModel,
    OptimizationInputData,
    OptimizationResult,
    ShardedModelBase,
    ShardingConfiguration,
    ZeRO1Optimizer,
)

pytestmark = pytest.mark.timeout(120)

W = 2
VOCAB = 50
# bias=False as in test_strategies.py: the key part of an attention bias has an exactly zero
# true gradient, and Adam turns its round-off noise into lr-sized steps that no two reduction
# orders agree on.
CFG = GPTConfig.tiny(vocab_size=VOCAB, bias=False)
LR = 1e-2
KINDS = ["ddp", "zero1", "zero2", "fsdp"]
SERVER_KINDS = ["zero1", "zero2", "fsdp"]
_CLASSES = DATA_PARALLEL

_gen = torch.Generator().manual_seed(1234)
X = torch.randint(0, VOCAB, (2 * W, CFG.block_size), generator=_gen)
Y = torch.randint(0, VOCAB, (2 * W, CFG.block_size), generator=_gen)
XV = torch.randint(0, VOCAB, (2, CFG.block_size), generator=_gen)
YV = torch.randint(0, VOCAB, (2, CFG.block_size), generator=_gen)


def rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return X[2 * rank : 2 * rank + 2], Y[2 * rank : 2 * rank + 2]


# -- helpers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def addrs() -> Any:
    started = [ShardServer("127.0.0.1", 0).start() for _ in range(W)]
    yield [s.address for s in started]
    for s in started:
        s.stop(0)


def init_state(
    cfg: GPTConfig = CFG, seed: int = 0, dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    """Built once, in the main thread; float64 unless asked otherwise."""
    torch.manual_seed(seed)
    return {k: v.to(dtype).clone() for k, v in GPT(cfg).state_dict().items()}


def plain(init: dict[str, torch.Tensor], cfg: GPTConfig = CFG) -> GPT:
    """A GPT in the dtype of ``init``, loaded with it."""
    m = GPT(cfg).to(next(iter(init.values())).dtype)
    m.load_state_dict(init)
    return m


def vec(module: nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(
        [p.detach() for p in module.parameters() if p.requires_grad]
    ).clone()


def reference(
    init: dict[str, torch.Tensor], steps: int, lr: float = LR, cfg: GPTConfig = CFG
) -> torch.Tensor:
    """Single-process AdamW on the whole batch."""
    m = plain(init, cfg)
    opt = torch.optim.AdamW(m.param_groups(0.1), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        lm_loss(m(X), Y).backward()
        opt.step()
    return vec(m)


def world(
    run_ranks: Callable[..., list[Any]],
    addrs: list[str],
    kind: str,
    fn: Callable[..., Any],
    *,
    init: dict[str, torch.Tensor] | None = None,
    cfg: GPTConfig = CFG,
    with_opt: bool = True,
    lr: float = LR,
    wait_s: float = 60.0,
    **conf: Any,
) -> list[Any]:
    """Runs ``fn(client, model, opt, rank_plain)`` on every rank; results in rank order."""
    init = init if init is not None else init_state(cfg)
    job = f"{kind}-{uuid.uuid4().hex[:10]}"
    model_cls, opt_cls = _CLASSES[kind]

    def per_rank(client: Any) -> Any:
        module = plain(init, cfg)
        config = ShardingConfiguration(client, job=job, timeout_s=20.0, **conf)
        if kind == "fsdp":
            model = FSDPModel(module, config, wrap=(Block,))
        else:
            model = model_cls(module, config)
        opt = None
        if with_opt:
            opt = opt_cls(torch.optim.AdamW(module.param_groups(0.1), lr=lr), config)
        return fn(client, model, opt, plain(init, cfg))

    return run_ranks(per_rank, W, addrs, wait_s=wait_s)


def train_accumulated(model: ShardedModelBase, opt: Any, x: Any, y: Any, steps: int) -> None:
    """``steps`` optimizer steps of two micro-batches each (gradient_accumulation_steps=2)."""
    for _ in range(steps):
        for i in range(2):
            (model.default_loss_function(model(x[i : i + 1]), y[i : i + 1]) / 2).backward()
        opt.step()
        opt.zero_grad()


def steps_of(model: ShardedModelBase) -> int:
    return getattr(model, "step_count", -1)


def names_both_lengths(msg: str, a: int, b: int) -> bool:
    digits = {int(s.replace(",", "")) for s in re.findall(r"\d[\d,]*", msg)}
    return a in digits and b in digits


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


# -- FSDP memory ---------------------------------------------------------------------------------


def test_fsdp_memory_bound_and_freeing(run_ranks: Any, addrs: list[str]) -> None:
    cfg = GPTConfig.tiny(vocab_size=VOCAB, n_layer=4, bias=False)  # float32: 4 bytes a value

    def fn(client: Any, model: FSDPModel, opt: Any, ref: GPT) -> None:
        sizes: dict[str, int] = {}
        for b in model._buffers:
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
