"""The strict test backend (tests/strict_backend.py) refuses what CuPy refuses, so the server's
tests run under it catch NumPy-only server code on the CPU; and the server works under it.

CI runs the server-side test files a second time with ``PARAMSHARD_TEST_BACKEND=strict``
(Makefile ``test-strict``); these tests prove that run can fail, and cover what it does not
reach (every optimizer's update on device arrays).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import strict_backend as strict
from test_optimizers import CASES, case_id

from paramshard.client import ClusterSpec, ShardClient, StepArgs
from paramshard.protos import shard_pb2 as pb
from paramshard.server.optimizers import make_optimizer
from paramshard.server.runtime import backend

WIRES = ("float32", "float16", "bfloat16", "float64")


@pytest.fixture
def strict_xp() -> Iterator[Any]:
    """The strict backend for this test; the process default again afterwards."""
    backend.use_device("strict")
    try:
        yield backend.xp
    finally:
        backend.use_device("cpu")


@pytest.fixture
def numpy_too(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``device="cpu"`` means NumPy in this test, also in a strict run (the reference)."""
    monkeypatch.delenv(backend.TEST_BACKEND_ENV, raising=False)
    yield
    monkeypatch.undo()
    backend.use_device("cpu")


def test_device_arrays_refuse_every_implicit_trip_to_numpy(strict_xp: Any) -> None:
    d = backend.to_device(np.arange(6, dtype=np.float32))
    host = np.zeros(6, np.float32)
    refused = {
        "np.asarray": lambda: np.asarray(d),
        "np.array": lambda: np.array(d),
        "np.frombuffer": lambda: np.frombuffer(d, np.float32),
        "memoryview": lambda: memoryview(d),
        "bytes": lambda: bytes(d),
        "tobytes": lambda: d.tobytes(),  # noqa: PLW0108 - the attribute itself raises
        "tolist": lambda: d.tolist(),  # noqa: PLW0108
        "data": lambda: d.data,
        "pickle": lambda: pickle.dumps(d),
        "protobuf bytes field": lambda: pb.PullParamsReply(data=d),
        "host[...] = device": lambda: host.__setitem__(Ellipsis, d),
        "device[...] = host": lambda: d.__setitem__(Ellipsis, host),
        "device + host": lambda: d + host,
        "host * device": lambda: host * d,
        "xp.maximum(device, host)": lambda: strict_xp.maximum(d, host),
        "np.concatenate([host, device])": lambda: np.concatenate([host, d]),
        "xp.asarray(host)": lambda: strict_xp.asarray(host),
        "xp.array(host)": lambda: strict_xp.array(host),
    }
    for what, attempt in refused.items():
        with pytest.raises(TypeError):
            attempt()
            pytest.fail(f"{what} passed on a strict device array")
    with pytest.raises(AttributeError):
        d.flags.writeable  # noqa: B018 - CuPy's flags have no writeable
    np.testing.assert_array_equal(host, 0)


def test_device_code_stays_on_the_device_and_crossings_copy(strict_xp: Any) -> None:
    source = np.arange(6, dtype=np.float32)
    d = backend.to_device(source)
    d[0] = 100.0
    assert source[0] == 0, "to_device must copy, as a host-to-device copy does"
    d *= 2
    d[1:3] += strict_xp.ones(2, dtype=np.float32)
    results = [
        strict_xp.sqrt(d),
        np.sqrt(d),  # NumPy ufuncs on device arrays dispatch to the device (NEP 13), as on CuPy
        np.concatenate([d, d]),  # ... and so do NumPy functions (NEP 18)
        strict_xp.where(d > 4, d, 0),
        d.astype(np.float64)[::2],
        d.sum(),
        d[3],
        backend.f32_to_bf16_bits(d),
    ]
    assert all(isinstance(r, strict.StrictArray) for r in results), [type(r) for r in results]
    assert float(d.sum()) == 232  # a one-element array may cross as a Python scalar (CuPy too)
    host = backend.to_host(d)
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host, [200, 3, 5, 6, 8, 10])
    host[0] = -1
    assert float(d[0]) == 200, "to_host must copy, as a device-to-host copy does"


def test_the_environment_variable_puts_cpu_servers_on_the_strict_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    try:
        monkeypatch.setenv(backend.TEST_BACKEND_ENV, "strict")
        backend.use_device("cpu")
        assert backend.xp is strict and backend.device == "cpu"
        monkeypatch.setenv(backend.TEST_BACKEND_ENV, "cupy")
        with pytest.raises(backend.BackendError, match="test backends are 'strict' and 'cuda"):
            backend.use_device("cpu")
        monkeypatch.setenv(backend.TEST_BACKEND_ENV, "cuda:0")  # make test-gpu's servers
        try:
            backend.use_device("cpu")
        except backend.BackendError as exc:  # no CuPy or no device: refused as --device is
            assert "device 'cuda:0'" in str(exc)
        else:
            assert backend.device == "cuda:0" and backend.xp is not np
    finally:
        monkeypatch.undo()
        backend.use_device("cpu")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_optimizer_steps_device_arrays_as_it_steps_numpy(
    case: tuple, strict_xp: Any, numpy_too: None
) -> None:
    """Every optimizer line runs on strict arrays and gives NumPy's bits (the same kernels)."""
    name, hyper = case
    rng = np.random.default_rng(7)
    p0 = rng.standard_normal(33).astype(np.float32)
    grads = rng.standard_normal((3, 33)).astype(np.float32)

    def run(device: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        backend.use_device(device)
        opt = make_optimizer(name, p0.size, hyper)
        param = backend.to_device(p0)
        for g in grads:
            opt.step(param, backend.to_device(g))
        if device == "strict":
            assert isinstance(param, strict.StrictArray)
        state = {k: backend.to_host(v) for k, v in opt.state_arrays().items()}
        return backend.to_host(param), state

    strict_param, strict_state = run("strict")
    numpy_param, numpy_state = run("cpu")
    np.testing.assert_array_equal(strict_param, numpy_param)
    assert strict_state.keys() == numpy_state.keys()
    for key, value in numpy_state.items():
        np.testing.assert_array_equal(strict_state[key], value, err_msg=key)


def _round_trip(servers: Any, device: str) -> dict[str, np.ndarray]:
    """Register, set, push (float32 and bfloat16 wire) over two steps with a clipped step,
    pull in every wire dtype, read optimizer state, all-reduce: on 2 servers of ``device``."""
    numel, job = 1000, f"strict-{device}"
    rng = np.random.default_rng(3)
    init = rng.standard_normal(numel).astype(np.float32)
    nodes = servers(2, device=device)
    c = ShardClient(ClusterSpec([s.address for s in nodes]), timeout_s=20)
    try:
        c.register_buffer(job, "w", numel, optimizer="adamw", hyper={"lr": 0.01})
        c.set_params(job, "w", init)
        for step, wire in enumerate(("float32", "bfloat16")):
            grad = rng.standard_normal(numel).astype(np.float32)
            c.push_grads(job, "w", grad, step, dtype=wire)
            check = c.grad_check(job, ["w"], step)
            clip = min(1.0, 10.0 / (check.sum_squares[0] ** 0.5 + 1e-6))
            c.step(job, step, {"w": StepArgs({"lr": 0.01}, clip_coef=clip)})
        master = nodes[0].servicer.buffers.get(job, "w").master
        assert isinstance(master, strict.StrictArray) == (device == "strict")
        out = {f"pull {d}": c.pull_params(job, "w", numel, 2, dtype=d) for d in WIRES}
        assert not np.array_equal(out["pull float32"], init), "two steps changed nothing"
        out["all_reduce"] = c.all_reduce(np.arange(7, dtype=np.float32))
        out["broadcast"] = c.broadcast(np.arange(5, dtype=np.float32), src=0)
        return out
    finally:
        c.close()
        for s in nodes:
            s.stop(0)


def test_push_step_pull_round_trip_equals_numpy(servers: Any, numpy_too: None) -> None:
    try:
        on_strict = _round_trip(servers, "strict")
    finally:
        backend.use_device("cpu")
    on_numpy = _round_trip(servers, "cpu")
    assert on_strict.keys() == on_numpy.keys()
    for what, values in on_numpy.items():
        np.testing.assert_array_equal(on_strict[what], values, err_msg=what)
