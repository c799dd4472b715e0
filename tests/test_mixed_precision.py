"""Mixed precision as FSDP2 defines it (strategies/mixed_precision.py) and loss scaling
(strategies/grad_scaler.py), on two ranks in threads against two in-process shard servers.

- Forward hooks see the compute dtype (``param_dtype``) on every strategy, and the gradients
  that reach the servers travel in ``reduce_dtype`` (read off the requests the client sends).
- A float64 model stays float64 by default and with ``param_dtype="float64"``.
- bfloat16 compute over 50 steps lands within 3x the deviation of torch's own FSDP2
  (``fully_shard`` with the same ``MixedPrecisionPolicy``, gloo, 2 ranks) from a float64
  single-process reference of the same model and data (tests/numerics.py).
- ``ShardedGradScaler``: float64 runs with a scale and clipping equal single-process float64
  (so ``unscale_`` and the clip coefficient are exact); float16 runs that overflow skip the
  step everywhere, leave the parameters untouched and back the scale off.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import strategy_world
import torch
from numerics import assert_equivalent, assert_within_twin, worst_deviation
from strategy_world import (
    KINDS,
    W,
    X,
    Y,
    addrs_fixture,  # noqa: F401 - the module's servers: ``addrs``
    init_state,
    plain,
    rank_data,
    reference,
)
from torch import nn

from paramshard.models.gpt import lm_loss
from paramshard.protos import codec
from paramshard.strategies import DDPModel, DDPOptimizer, ShardedGradScaler, ShardingConfiguration

pytestmark = pytest.mark.timeout(240)


def double(init: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float64 copy single-process references train from."""
    return {k: v.double() for k, v in init.items()}


def world(
    run_ranks: Callable[..., list[Any]],
    addrs: list[str],
    kind: str,
    fn: Callable[..., Any],
    init: dict[str, torch.Tensor],
    lr: float = 1e-2,
    **conf: Any,
) -> list[Any]:
    """``fn(client, model, opt)`` on every rank (strategy_world's world), results in rank
    order."""
    return strategy_world.world(
        run_ranks, addrs, kind, lambda c, m, o, _plain: fn(c, m, o), init=init, lr=lr,
        wait_s=200.0, **conf,
    )  # fmt: skip


def record_wire(client: Any) -> list[tuple[str, str, int]]:
    """(method, dtype, payload bytes) of every gradient the client sends (PushGrad for the
    servers' buffers, ContributeRead for DDP's all-reduce), read off the built requests."""
    seen: list[tuple[str, str, int]] = []
    run = client.run

    def recording(calls: Any, *args: Any, **kwargs: Any) -> Any:
        calls = list(calls)
        for call in calls:
            if call.method in ("PushGrad", "ContributeRead"):
                request = call.request() if callable(call.request) else call.request
                header, payload = request
                dtype = codec.WIRE_DTYPES[header.chunk.dtype][0]
                size = payload.nbytes if hasattr(payload, "nbytes") else len(payload)
                seen.append((call.method, dtype, size))
        return run(calls, *args, **kwargs)

    client.run = recording
    return seen


# -- what forward computes in, what gradients travel in ---------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_forward_sees_param_dtype_and_gradients_leave_in_reduce_dtype(
    kind: str, run_ranks: Any, addrs: list[str]
) -> None:
    """param_dtype="bfloat16", reduce_dtype="float16": a forward hook sees bfloat16 weights
    and activations, every gradient on the wire is float16 (2 bytes a value), and the float32
    masters come back from state_dict()."""
    init = init_state(dtype=torch.float32)

    def fn(client: Any, model: Any, opt: Any) -> dict[str, Any]:
        seen: dict[str, set] = {"weight": set(), "input": set()}
        attn = model.module.blocks[0].attn.c_attn

        def hook(module: nn.Module, args: Any) -> None:
            seen["weight"].add(module.weight.dtype)
            seen["input"].add(args[0].dtype)

        attn.register_forward_pre_hook(hook)
        wire = record_wire(client)
        x, y = rank_data(client.rank)
        losses = [model.train_on_batch(x, y) for _ in range(2)]
        with torch.no_grad():
            out = model(x)
        return {
            "seen": seen,
            "wire": wire,
            "losses": losses,
            "out": out.dtype,
            "params after": {p.dtype for p in model.module.parameters()},
            "state": {v.dtype for v in model.state_dict().values()},
            "vector": model.get_parameters(),
        }

    out = world(run_ranks, addrs, kind, fn, init, param_dtype="bfloat16", reduce_dtype="float16")
    for r in out:
        assert r["seen"]["weight"] == {torch.bfloat16}, r["seen"]
        assert r["seen"]["input"] == {torch.bfloat16}, r["seen"]
        assert r["out"] == torch.bfloat16  # outputs stay in param_dtype (output_dtype=None)
        assert r["losses"][1] < r["losses"][0]
        grads = r["wire"]
        assert grads, "no gradient was sent"
        assert {d for _, d, _ in grads} == {"float16"}, grads
        assert all(n % 2 == 0 for *_, n in grads)
        n_params = sum(v.numel() for k, v in init.items() if k != "lm_head.weight")
        assert sum(n for *_, n in grads) == 2 * 2 * n_params  # two steps, two bytes a value
        # the masters stay float32: state_dict and the flat vector are float32
        assert r["state"] == {torch.float32}
        assert r["vector"].dtype == torch.float32
        assert worst_deviation(r["vector"], r["vector"].bfloat16().float()) > 0
        want = {"ddp": torch.float32, "fsdp": torch.float32}.get(kind, torch.bfloat16)
        assert r["params after"] == {want}  # ZeRO's replica is the bfloat16 working copy
    assert torch.equal(out[0]["vector"], out[1]["vector"])


@pytest.mark.parametrize("kind", ["ddp", "zero2", "fsdp"])
@pytest.mark.parametrize("param_dtype", [None, "float64"])
def test_float64_model_stays_float64(
    kind: str, param_dtype: str | None, run_ranks: Any, addrs: list[str]
) -> None:
    init = init_state(dtype=torch.float64)
    want = reference(init, 2, lr=1e-2)

    def fn(client: Any, model: Any, opt: Any) -> Any:
        seen = set()
        model.module.blocks[0].mlp.c_fc.register_forward_pre_hook(
            lambda m, args: seen.add((m.weight.dtype, args[0].dtype))
        )
        wire = record_wire(client)
        x, y = rank_data(client.rank)
        for _ in range(2):
            model.train_on_batch(x, y)
        return seen, {d for _, d, _ in wire}, model.get_parameters()

    for seen, wire, params in world(run_ranks, addrs, kind, fn, init, param_dtype=param_dtype):
        assert seen == {(torch.float64, torch.float64)}
        assert wire == {"float64"}
        assert_equivalent(params, want, f"{kind} float64 param_dtype={param_dtype}")


def test_float_inputs_cast_to_param_dtype(run_ranks: Any, addrs: list[str]) -> None:
    """FSDP2's cast_forward_inputs: floating inputs of the root forward arrive in param_dtype,
    integer ones untouched."""
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in nn.Sequential(nn.Linear(4, 3)).state_dict().items()}

    def fn(client: Any) -> Any:
        module = nn.Sequential(nn.Linear(4, 3))
        module.load_state_dict(init)
        config = ShardingConfiguration(client, job=job, param_dtype="bfloat16", timeout_s=20.0)
        model = DDPModel(module, config)
        DDPOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), config)
        seen = []
        module[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        with torch.no_grad():
            out = model(torch.ones(2, 4))
        return seen, out.dtype, {p.dtype for p in module.parameters()}

    job = f"mp-inputs-{uuid.uuid4().hex[:8]}"
    for seen, out, params in run_ranks(fn, W, addrs):
        assert seen == [torch.bfloat16] and out == torch.bfloat16
        assert params == {torch.float32}  # a no-grad forward swaps the float32 ones back


# -- bfloat16 against torch's FSDP2 -------------------------------------------------------------

LR_BF16, STEPS_BF16 = 3e-3, 50


def fsdp2_twin_rank(rank: int, world: int, init: dict, lr: float, steps: int) -> torch.Tensor:
    """One rank of torch's FSDP2 (``fully_shard`` per block and at the root, gloo) computing
    in bfloat16 and reducing in float32, the loss taken on float32 logits as
    ``train_on_batch`` does (runs in a spawned process)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    net = plain(init)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in net.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(net, mp_policy=policy)
    opt = torch.optim.AdamW(net.param_groups(0.1), lr=lr)
    x, y = rank_data(rank)
    for _ in range(steps):
        lm_loss(net(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in net.parameters()])


@pytest.mark.equivalence
def test_bfloat16_compute_within_torch_fsdp2(run_ranks: Any, addrs: list[str]) -> None:
    """50 steps of bfloat16 compute, float32 masters and reduction: FSDP, ZeRO-2 and DDP stay
    within 3x the deviation of torch's FSDP2 with the same MixedPrecisionPolicy, both measured
    against float64 single-process training (tests/numerics.py ``assert_within_twin``)."""
    from torch_twin import run_gloo

    init = init_state(dtype=torch.float32)
    want = reference(double(init), STEPS_BF16, lr=LR_BF16)
    twin = run_gloo(fsdp2_twin_rank, W, init, LR_BF16, STEPS_BF16)[0]
    twin_gap = worst_deviation(twin, want)
    assert twin_gap > 1e-3  # bfloat16 compute really moved torch's own run that far

    def fn(client: Any, model: Any, opt: Any) -> torch.Tensor:
        x, y = rank_data(client.rank)
        for _ in range(STEPS_BF16):
            model.train_on_batch(x, y)
        return model.get_parameters()

    for kind in ("fsdp", "zero2", "ddp"):
        out = world(
            run_ranks,
            addrs,
            kind,
            fn,
            init,
            lr=LR_BF16,
            param_dtype="bfloat16",
            reduce_dtype="float32",
        )
        for r, params in enumerate(out):
            assert params.dtype == torch.float32  # the masters stay float32
            ours = assert_within_twin(params, twin, want, f"{kind} bfloat16 rank {r}")
            assert ours > twin_gap / 3  # and ours: it computed in bfloat16 too


# -- loss scaling ---------------------------------------------------------------------------


def scaled_step(model: Any, opt: Any, scaler: ShardedGradScaler, x: Any, y: Any, clip: Any):
    """One iteration as torch documents GradScaler: scaled backward, unscale_, clip, step,
    update."""
    loss = lm_loss(model(x), y)  # float64 here
    scaler.scale(loss).backward()
    if clip is not None:
        scaler.unscale_(opt)
        model.clip_grad_norm_(clip)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


@pytest.mark.equivalence
@pytest.mark.parametrize("kind", ["ddp", "zero1", "fsdp"])
def test_scaler_unscales_exactly(kind: str, run_ranks: Any, addrs: list[str]) -> None:
    """float64, a scale of 2**10 and clipping that bites: unscale_ divides the norm clipping
    sees and the servers fold 1/scale into the clip coefficient, so training equals
    single-process float64 with the same clipping (1e-9, tests/numerics.py)."""
    init = init_state(dtype=torch.float64)
    want = reference(init, 3, lr=1e-2, max_norm=0.05)

    def fn(client: Any, model: Any, opt: Any) -> Any:
        scaler = ShardedGradScaler(init_scale=2.0**10)
        x, y = rank_data(client.rank)
        for _ in range(3):
            scaled_step(model, opt, scaler, x, y, clip=0.05)
        return model.get_parameters(), scaler.get_scale(), model.skipped_steps

    for params, scale, skipped in world(run_ranks, addrs, kind, fn, init):
        assert (scale, skipped) == (2.0**10, 0)
        assert_equivalent(params, want, f"{kind} scaled by 2**10, clipped")


# An overflowing fp16 gradient is input the servers expect (the step is skipped everywhere):
# adding +inf and -inf must not make NumPy warn, in the server's threads or anywhere.
@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("kind", ["ddp", "zero2", "fsdp"])
def test_float16_overflow_skips_everywhere_and_backs_off(
    kind: str, run_ranks: Any, addrs: list[str]
) -> None:
    """float16 compute from a scale far too large: the gradients overflow, every rank and
    server skips the step (no error, although skip_nonfinite is False), the parameters stay
    bitwise as they were and the scale halves, until it fits and training goes on."""
    init = init_state(dtype=torch.float32)

    def fn(client: Any, model: Any, opt: Any) -> Any:
        scaler = ShardedGradScaler(init_scale=2.0**24, growth_interval=3)
        x, y = rank_data(client.rank)
        start = model.get_parameters()
        log = []
        for _ in range(16):
            before = model.get_parameters()
            scale = scaler.get_scale()
            loss = lm_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            skipped = model.skipped_steps
            scaler.step(opt)
            taken = model.skipped_steps == skipped
            scaler.update()
            opt.zero_grad()
            same = torch.equal(model.get_parameters(), before)
            log.append((scale, taken, same, float(loss.detach())))
        return log, model.skipped_steps, torch.equal(model.get_parameters(), start)

    logs = world(run_ranks, addrs, kind, fn, init, param_dtype="float16")
    decisions = [[entry[:3] for entry in log] for log, _, _ in logs]
    assert decisions[0] == decisions[1], "the ranks disagree on which steps were taken"
    log, skipped, unchanged = logs[0]
    takens = [t for _, t, _, _ in log]
    assert not takens[0] and any(takens) and not unchanged
    assert skipped == takens.count(False)
    for (scale, taken, same, _), (next_scale, *_) in zip(log, log[1:], strict=False):
        assert same == (not taken)  # a skipped step changes nothing, a taken one does
        if not taken:
            assert next_scale == scale / 2
    good = [i for i, t in enumerate(takens) if t]
    first = good[0]
    if all(takens[first : first + 3]) and first + 3 < len(log):
        assert log[first + 3][0] == 2 * log[first][0]  # grew after growth_interval good steps
    assert log[-1][3] < log[first][3]


def test_hybrid_pipeline_stages_compute_in_param_dtype(run_ranks: Any, addrs: list[str]) -> None:
    """3D (two pipeline stages): each stage's replica is the bfloat16 working copy, so its
    layers compute in bfloat16, and state_dict() still gives the servers' float32 masters."""
    from paramshard.strategies import HybridShardedModel, HybridShardedOptimizer

    init = init_state(dtype=torch.float32)
    job = f"mp-hybrid-{uuid.uuid4().hex[:8]}"

    def fn(client: Any) -> Any:
        config = ShardingConfiguration(client, job=job, param_dtype="bfloat16", timeout_s=20.0)
        model = HybridShardedModel(plain(init), config, 2, 1, 1, micro_batch_count=2)
        HybridShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
        seen, loss_inputs = set(), set()
        for m in model.stage.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_pre_hook(lambda m, a: seen.add((m.weight.dtype, a[0].dtype)))
        loss_of = model.default_loss_function
        model.default_loss_function = lambda out, y: loss_inputs.add(out.dtype) or loss_of(out, y)
        losses = [model.train_on_batch(X, Y) for _ in range(3)]
        return seen, loss_inputs, losses, model.state_dict()

    out = run_ranks(fn, W, addrs)
    # the last stage takes the loss in float32, as train_on_batch does for the other strategies
    assert set().union(*(o[1] for o in out)) == {torch.float32}
    out = [(seen, losses, state) for seen, _, losses, state in out]
    for seen, losses, state in out:
        assert seen == {(torch.bfloat16, torch.bfloat16)}
        assert losses[-1] < losses[0]
        assert {v.dtype for v in state.values()} == {torch.float32}
        assert any(not torch.equal(v, v.bfloat16().float()) for v in state.values())
    assert all(torch.equal(out[0][2][k], out[1][2][k]) for k in out[0][2])


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_gathered_parameter_bytes_halve(strategy: str) -> None:
    """benchmarks/mixed_precision.py's measurement: FSDP's peak of gathered parameter bytes
    and ZeRO's replica hold half the bytes with bfloat16 compute (the storages counted)."""
    from benchmarks.mixed_precision import run

    fp32 = run(strategy, "tiny", W, 1, None)
    bf16 = run(strategy, "tiny", W, 1, "bfloat16")
    assert fp32 > 0 and bf16 * 2 == fp32
