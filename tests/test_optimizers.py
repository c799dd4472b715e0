"""paramshard.server.optimizers against torch.optim's single-tensor CPU path (foreach=False).

The server must reproduce torch's updates so that a model trained through shard servers
ends where local torch training would. Float32 shards are held to a measured bound: after 1 to
100 steps they are no further from the exact result (torch on float64 tensors) than 3x torch's
own float32 result is (tests/numerics.py ``assert_within_twin``); a fixed tolerance would be a
guess that torch's FMA/vectorised kernels meet on one CPU and miss on another (see the module
docstring of server.optimizers). Float64 shards meet 1e-9: tests/test_server_float64.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from numerics import assert_within_twin

from paramshard.server.optimizers import (
    OPTIMIZERS,
    OptimizerError,
    ServerOptimizer,
    kernels,
    make_optimizer,
)
from paramshard.server.runtime import backend

NUMEL = 1001  # odd on purpose: exercises torch's vectorised loop tail
STEPS = 100
CHECKPOINTS = (1, 2, 10, 50, STEPS)

TORCH_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}

ADAM_CASES: list[dict[str, float]] = [
    {},
    {"lr": 1e-2},
    {"lr": 1e-2, "amsgrad": 1.0},
    {"lr": 1e-2, "weight_decay": 0.1},
    {"lr": 3e-3, "weight_decay": 0.05, "amsgrad": 1.0, "maximize": 1.0},
    {"lr": 1e-2, "beta1": 0.3, "beta2": 0.9, "eps": 1e-6},  # lerp's |w| >= 0.5 branch
    {"lr": 1e-2, "weight_decay": 0.0, "maximize": 1.0},
]

CASES: list[tuple[str, dict[str, float]]] = [
    ("sgd", {}),
    ("sgd", {"lr": 0.05}),
    ("sgd", {"lr": 0.02, "momentum": 0.9}),
    ("sgd", {"lr": 0.02, "momentum": 0.9, "dampening": 0.3}),
    ("sgd", {"lr": 0.02, "momentum": 0.9, "nesterov": 1.0}),
    ("sgd", {"lr": 0.05, "weight_decay": 0.01}),
    ("sgd", {"lr": 0.01, "momentum": 0.5, "weight_decay": 0.1, "maximize": 1.0}),
    ("sgd", {"lr": 0.01, "momentum": 0.9, "nesterov": 1.0, "weight_decay": 0.05, "maximize": 1.0}),
    *[("adam", c) for c in ADAM_CASES],
    *[("adamw", c) for c in ADAM_CASES],
    ("adagrad", {}),
    ("adagrad", {"lr": 0.1, "lr_decay": 0.01}),
    ("adagrad", {"initial_accumulator_value": 0.1}),
    (
        "adagrad",
        {
            "lr_decay": 1e-3,
            "weight_decay": 0.01,
            "initial_accumulator_value": 0.5,
            "eps": 1e-6,
            "maximize": 1.0,
        },
    ),
    ("rmsprop", {}),
    ("rmsprop", {"centered": 1.0}),
    ("rmsprop", {"momentum": 0.9, "lr": 1e-3}),
    ("rmsprop", {"centered": 1.0, "momentum": 0.5, "weight_decay": 0.01}),
    ("rmsprop", {"alpha": 0.3, "centered": 1.0, "maximize": 1.0}),  # lerp's |w| >= 0.5 branch
    ("rmsprop", {"alpha": 0.9, "eps": 1e-6, "lr": 1e-3}),
]


def case_id(case: tuple[str, Mapping[str, float]]) -> str:
    name, hyper = case
    return "-".join([name, *(f"{k}={v:g}" for k, v in hyper.items())]) or name


@pytest.fixture(autouse=True)
def numpy_backend() -> None:
    backend.use_device("cpu")


def torch_optimizer(name: str, param: torch.Tensor, hyper: Mapping[str, float]):
    """torch.optim equivalent of our (name, hyper): betas re-tupled, flags as bools."""
    cls = OPTIMIZERS[name]
    kwargs: dict[str, object] = {}
    for key, value in {**cls.defaults, **hyper}.items():
        kwargs[key] = bool(value) if key in cls.flags else value
    if "beta1" in kwargs:
        kwargs["betas"] = (kwargs.pop("beta1"), kwargs.pop("beta2"))
    return TORCH_CLASSES[name]([param], foreach=False, **kwargs)


def data(seed: int, steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(NUMEL).astype(np.float32)
    grads = rng.standard_normal((steps, NUMEL)).astype(np.float32)
    return p0, grads


def run_ours(
    opt: ServerOptimizer, param: np.ndarray, grads: np.ndarray, lrs: Sequence[float] | None = None
) -> list[np.ndarray]:
    """Step through ``grads``; returns param copies at CHECKPOINTS (1-based step numbers)."""
    seen = []
    for i, g in enumerate(grads, start=1):
        if lrs is not None:
            opt.update_hyper({"lr": lrs[i - 1]})
        opt.step(param, g.copy())
        if i in CHECKPOINTS:
            seen.append(param.copy())
    return seen


def run_torch(
    name: str,
    hyper: Mapping[str, float],
    p0: np.ndarray,
    grads: np.ndarray,
    lrs: Sequence[float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[np.ndarray], dict[str, torch.Tensor]]:
    """The reference run: torch.optim single-tensor path; returns checkpoints and state.
    ``dtype=torch.float64``: the exact result the float32 runs are measured against."""
    param = torch.tensor(p0, dtype=dtype, requires_grad=True)
    opt = torch_optimizer(name, param, hyper)
    seen = []
    for i, g in enumerate(grads, start=1):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[i - 1]
        param.grad = torch.from_numpy(g.copy()).to(dtype)
        opt.step()
        if i in CHECKPOINTS:
            seen.append(param.detach().numpy().copy())
    return seen, opt.state[param]


@pytest.mark.equivalence
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_torch(case: tuple[str, dict[str, float]]) -> None:
    name, hyper = case
    p0, grads = data(seed=CASES.index(case))
    expected, torch_state = run_torch(name, hyper, p0, grads)
    exact, exact_state = run_torch(name, hyper, p0, grads, dtype=torch.float64)
    opt = make_optimizer(name, NUMEL, hyper)
    got = run_ours(opt, p0.copy(), grads)
    for step, want, have, truth in zip(CHECKPOINTS, expected, got, exact, strict=True):
        assert_within_twin(have, want, truth, f"{case_id(case)} step {step}")
    # Same state keys as torch (tensors only; torch's "step" is our step_count).
    ours = opt.state_arrays()
    assert set(ours) == {k for k, v in torch_state.items() if k != "step" and v is not None}
    for key, arr in ours.items():
        assert arr.dtype == np.float32, key
        twin, truth = torch_state[key].numpy(), exact_state[key].numpy()
        assert_within_twin(arr, twin, truth, f"{case_id(case)} {key}")
    assert opt.step_count == STEPS
    assert opt.state_bytes() == 4 * NUMEL * len(ours)


@pytest.mark.equivalence
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_lr_changing_every_step_matches_torch_scheduler(name: str) -> None:
    p0, grads = data(seed=1234)
    base = {"sgd": 0.05, "adagrad": 0.05}.get(name, 1e-2)
    lrs = [base * (0.5 + 0.5 * float(np.cos(np.pi * t / STEPS))) + 1e-4 for t in range(STEPS)]
    hyper = {"momentum": 0.9} if name in ("sgd", "rmsprop") else {}
    expected, _ = run_torch(name, hyper, p0, grads, lrs)
    exact, _ = run_torch(name, hyper, p0, grads, lrs, dtype=torch.float64)
    opt = make_optimizer(name, NUMEL, hyper)
    got = run_ours(opt, p0.copy(), grads, lrs)
    assert_within_twin(got[-1], expected[-1], exact[-1], f"{name} with a scheduled lr")
    assert opt.hyper["lr"] == lrs[-1]


class _NumpyWithTorchSqrt:
    """NumPy except ``sqrt``, taken from torch (MKL on CPU): the one kernel we cannot mirror."""

    def __getattr__(self, attr: str) -> object:
        return getattr(np, attr)

    @staticmethod
    def sqrt(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        root = torch.from_numpy(x).sqrt().numpy()
        if out is None:
            return root
        out[...] = root
        return out


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="bit-exactness assumes ATen's FMA-vectorised x86 kernels",
)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bit_identical_to_torch_given_its_sqrt(
    case: tuple[str, dict[str, float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With torch's sqrt swapped in, every other op must round exactly as torch does.

    This pins the term-by-term translation (operation order, float32 scalar rounding,
    FMAs) far tighter than the 1e-6 tolerance; a small CHUNK exercises fma's chunking.
    """
    name, hyper = case
    p0, grads = data(seed=CASES.index(case), steps=30)
    expected, torch_state = run_torch(name, hyper, p0, grads)
    monkeypatch.setattr(backend, "xp", _NumpyWithTorchSqrt())
    monkeypatch.setattr(kernels, "CHUNK", 100)
    opt = make_optimizer(name, NUMEL, hyper)
    got = run_ours(opt, p0.copy(), grads)
    np.testing.assert_array_equal(got[-1], expected[-1])
    for key, arr in opt.state_arrays().items():
        np.testing.assert_array_equal(arr, torch_state[key].numpy(), err_msg=key)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_defaults_equal_torch(name: str) -> None:
    torch_defaults = TORCH_CLASSES[name]([torch.zeros(1, requires_grad=True)]).defaults
    for key, value in make_optimizer(name, 1, {}).hyper.items():
        if key in ("beta1", "beta2"):
            assert value == torch_defaults["betas"][key == "beta2"]
        else:
            assert value == float(torch_defaults[key]), key


INVALID: list[tuple[str, str, object, bool]] = [
    # (optimizer, key, value, torch also rejects it)
    ("sgd", "lr", -0.1, True),
    ("sgd", "momentum", -0.5, True),
    ("sgd", "weight_decay", -1.0, True),
    ("sgd", "nesterov", 1.0, True),  # momentum defaults to 0
    ("sgd", "maximize", 0.5, False),
    ("adam", "beta1", 1.0, True),
    ("adam", "beta2", -0.1, True),
    ("adam", "eps", -1e-8, True),
    ("adam", "lr", float("nan"), False),
    ("adamw", "weight_decay", -0.01, True),
    ("adamw", "amsgrad", 2.0, False),
    ("adagrad", "lr_decay", -1.0, True),
    ("adagrad", "initial_accumulator_value", -0.1, True),
    ("adagrad", "eps", float("inf"), False),
    ("rmsprop", "alpha", -0.1, True),
    ("rmsprop", "momentum", -0.9, True),
    ("rmsprop", "lr", "fast", False),
    ("rmsprop", "betas", 0.9, False),
]


@pytest.mark.parametrize(("name", "key", "value", "torch_rejects"), INVALID)
def test_invalid_hyper_raises(name: str, key: str, value: object, torch_rejects: bool) -> None:
    with pytest.raises(OptimizerError) as info:
        make_optimizer(name, 10, {key: value})
    message = str(info.value)
    assert name in message and key in message and "lr" in message
    if torch_rejects:
        with pytest.raises(ValueError):
            torch_optimizer(name, torch.zeros(1, requires_grad=True), {key: value})


def test_nesterov_needs_zero_dampening() -> None:
    with pytest.raises(OptimizerError, match="dampening"):
        make_optimizer("sgd", 4, {"momentum": 0.9, "nesterov": 1.0, "dampening": 0.1})


def test_unknown_optimizer_lists_known_names() -> None:
    with pytest.raises(OptimizerError) as info:
        make_optimizer("lamb", 4, {})
    assert "lamb" in str(info.value)
    assert all(name in str(info.value) for name in OPTIMIZERS)


@pytest.mark.parametrize(("name", "bad"), [("adam", {"lr": 1e-2, "beta2": 1.5}), ("sgd", {"x": 1})])
def test_update_hyper_invalid_changes_nothing(name: str, bad: dict[str, float]) -> None:
    opt = make_optimizer(name, 8, {"lr": 0.1})
    before = dict(opt.hyper)
    with pytest.raises(OptimizerError):
        opt.update_hyper(bad)
    assert opt.hyper == before


def test_update_hyper_refuses_state_torch_never_allocated() -> None:
    opt = make_optimizer("adam", 8, {})
    opt.update_hyper({"amsgrad": 1.0})  # fine before the first step
    opt.update_hyper({"amsgrad": 0.0})
    opt.step(np.zeros(8, np.float32), np.ones(8, np.float32))
    with pytest.raises(OptimizerError, match="amsgrad"):
        opt.update_hyper({"amsgrad": 1.0})
    assert opt.hyper["amsgrad"] == 0.0


@pytest.mark.parametrize("case", [c for c in CASES if c[1]], ids=case_id)
def test_state_round_trip_continues_identically(case: tuple[str, dict[str, float]]) -> None:
    name, hyper = case
    p0, grads = data(seed=7, steps=20)
    whole = make_optimizer(name, NUMEL, hyper)
    p_whole = p0.copy()
    run_ours(whole, p_whole, grads)

    first = make_optimizer(name, NUMEL, hyper)
    p_split = p0.copy()
    run_ours(first, p_split, grads[:8])
    snapshot = {k: v.copy() for k, v in first.state_arrays().items()}
    second = make_optimizer(name, NUMEL, hyper)
    second.load_state(snapshot, first.step_count)
    assert second.state_bytes() == first.state_bytes()
    run_ours(second, p_split, grads[8:])
    np.testing.assert_array_equal(p_split, p_whole)
    assert second.step_count == whole.step_count


def test_load_state_validates_sizes_and_names() -> None:
    opt = make_optimizer("adam", 8, {})
    with pytest.raises(OptimizerError, match=r"exp_avg.*5.*8"):
        opt.load_state({"exp_avg": np.zeros(5, np.float32)}, 3)
    with pytest.raises(OptimizerError, match="momentum_buffer"):
        opt.load_state({"momentum_buffer": np.zeros(8, np.float32)}, 3)
    with pytest.raises(OptimizerError, match="exp_avg_sq"):
        opt.load_state({"exp_avg": np.zeros(8, np.float32)}, 3)


def test_state_is_lazy_like_torch() -> None:
    sgd = make_optimizer("sgd", 16, {"momentum": 0.9})
    adam = make_optimizer("adam", 16, {"amsgrad": 1.0})
    adagrad = make_optimizer("adagrad", 16, {"initial_accumulator_value": 0.25})
    assert sgd.state_bytes() == 0 and adam.state_bytes() == 0
    assert adagrad.state_bytes() == 64  # torch allocates "sum" in Adagrad.__init__
    np.testing.assert_array_equal(adagrad.state_arrays()["sum"], np.full(16, 0.25, np.float32))
    for opt in (sgd, adam):
        opt.step(np.zeros(16, np.float32), np.ones(16, np.float32))
    assert sgd.state_bytes() == 64
    assert adam.state_bytes() == 3 * 64


def test_server_module_does_not_import_torch() -> None:
    code = "import sys, paramshard.server.optimizers; sys.exit('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0
