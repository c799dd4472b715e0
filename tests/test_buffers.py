"""The flat-buffer API: register, set and pull params, versions, restores, dropping a job;
its gradients and steps: test_buffer_steps.py.

Every test runs over each ``transport`` (conftest.py): in-process calls, gRPC with payloads in
shared segments, and gRPC with payloads in-band."""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any

import numpy as np
import pytest
import torch

from paramshard.client import ClusterSpec, ParamInfo, ShardClient, ShardClientError
from paramshard.protos.slicing import slice_bounds

pytestmark = pytest.mark.usefixtures("transport")

BUF = "unit0"
TOL = {"rtol": 1e-6, "atol": 1e-7}


def client(addresses: list[str], rank: int = 0, world: int = 1, **kw: Any) -> ShardClient:
    kw.setdefault("timeout_s", 20.0)
    return ShardClient(ClusterSpec(list(addresses)), rank=rank, world_size=world, **kw)


def grads(rank: int, numel: int, step: int = 0, micro: int = 0) -> np.ndarray:
    """Dyadic gradients: every fp32 sum of them is exact, whatever the order of arrival."""
    rng = np.random.default_rng([rank, numel, step, micro])
    return (rng.integers(-1000, 1001, numel) * 2.0**-10).astype(np.float32)


def initial(numel: int) -> np.ndarray:
    return np.random.default_rng(numel).standard_normal(numel).astype(np.float32)


def sgd(params: np.ndarray, grad: np.ndarray, lr: float) -> np.ndarray:
    return (params.astype(np.float64) - np.float64(np.float32(lr)) * grad).astype(np.float32)


def average(per_rank: list[np.ndarray]) -> np.ndarray:
    return np.sum(per_rank, axis=0, dtype=np.float32) / np.float32(len(per_rank))


def setup_buffer(
    addresses: list[str],
    job: str,
    numel: int,
    world: int,
    *,
    optimizer: str = "sgd",
    hyper: dict | None = None,
    buffers: tuple[str, ...] = (BUF,),
) -> dict[str, np.ndarray]:
    """Registers and initialises the buffers from a rank-0 client; returns their values."""
    values = {}
    with_client = client(addresses, 0, world)
    try:
        for b in buffers:
            with_client.register_buffer(
                job, b, numel, optimizer=optimizer, hyper=hyper or {"lr": 0.1}
            )
            values[b] = initial(numel)
            with_client.set_params(job, b, values[b])
    finally:
        with_client.close()
    return values


def statuses(addresses: list[str]) -> list[dict[str, Any]]:
    c = client(addresses)
    try:
        return c.status()
    finally:
        c.close()


def buffer_status(row: dict[str, Any], job: str, buffer: str = BUF) -> dict[str, Any] | None:
    for j in row.get("jobs", []):
        if j["job"] == job:
            for b in j["buffers"]:
                if b["buffer"] == buffer:
                    return b
    return None


def versions(addresses: list[str], job: str, buffer: str = BUF) -> list[int]:
    return [int(buffer_status(row, job, buffer)["version"]) for row in statuses(addresses)]


# --- register, set, pull ---------------------------------------------------------------------


def test_register_manifest_set_and_pull(servers, job_name: str) -> None:
    addresses = [s.address for s in servers(3)]
    numel = 1000  # not divisible by 3: slices of 334, 333, 333
    params = [ParamInfo("w", (10, 50), 0), ParamInfo("b", (500,), 500, "bfloat16")]
    c = client(addresses)
    try:
        replies = c.register_buffer(
            job_name, BUF, numel, params=params, optimizer="adam", hyper={"lr": 1e-3}
        )
        for i, r in enumerate(replies):
            lo, hi = slice_bounds(numel, 3, i)
            assert (r.slice_start, r.slice_numel, r.version, r.initialized) == (
                lo,
                hi - lo,
                0,
                False,
            )
        assert [r.slice_numel for r in replies] == [334, 333, 333]
        for i, row in enumerate(statuses(addresses)):
            b = buffer_status(row, job_name)
            assert b is not None and int(b["numel"]) == numel and b["optimizer"] == "adam"
            assert int(row["server_index"]) == i and int(row["num_servers"]) == 3
            assert b["initialized"] is False
            manifest = [
                (
                    p["name"],
                    [int(d) for d in p["shape"]],
                    p["dtype"],
                    int(p["offset"]),
                    int(p["numel"]),
                )
                for p in b["params"]
            ]
            assert manifest == [
                ("w", [10, 50], "float32", 0, 500),
                ("b", [500], "bfloat16", 500, 500),
            ]
        values = initial(numel)
        c.set_params(job_name, BUF, values)
        np.testing.assert_array_equal(c.pull_params(job_name, BUF, numel), values)
        assert all(buffer_status(row, job_name)["initialized"] for row in statuses(addresses))
        # any range of the buffer, across slice boundaries
        out = np.empty(400, dtype=np.float32)
        c.run(c.pull_calls(job_name, BUF, out, 0, start=300, numel=numel))
        np.testing.assert_array_equal(out, values[300:700])
    finally:
        c.close()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_pull_in_half_precision(servers, job_name: str) -> None:
    addresses = [s.address for s in servers(2)]
    numel = 777
    values = setup_buffer(addresses, job_name, numel, 1)[BUF]
    values[:4] = [1.00390625, 1.01171875, -3.0e38, 1e-40]  # ties, overflow, subnormal
    c = client(addresses)
    try:
        c.set_params(job_name, BUF, values)
        bf16 = c.pull_params(job_name, BUF, numel, dtype="bfloat16")
        assert bf16.dtype == np.uint16
        want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
        np.testing.assert_array_equal(bf16, want.view(np.uint16))
        fp16 = c.pull_params(job_name, BUF, numel, dtype="float16")
        assert fp16.dtype == np.float16
        np.testing.assert_array_equal(fp16, values.astype(np.float16))
        # the fp32 master is untouched by lower-precision reads
        np.testing.assert_array_equal(c.pull_params(job_name, BUF, numel), values)
    finally:
        c.close()


def test_register_again_is_idempotent_other_layout_is_refused(servers, job_name: str) -> None:
    addresses = [s.address for s in servers(3)]
    c = client(addresses, 0, 2)
    try:
        first = c.register_buffer(job_name, BUF, 100, optimizer="sgd", hyper={"lr": 0.1})
        c.set_params(job_name, BUF, np.ones(100, np.float32), version=3)
        again = c.register_buffer(job_name, BUF, 100, optimizer="sgd", hyper={"lr": 0.1})
        assert [(r.slice_start, r.slice_numel) for r in again] == [
            (r.slice_start, r.slice_numel) for r in first
        ]
        assert all(r.version == 3 and r.initialized for r in again)  # the existing buffer
        for change in ({"numel": 101}, {"optimizer": "adam"}, {"contributors": 3}):
            kw = {"numel": 100, "optimizer": "sgd", "contributors": None} | change
            numel = kw.pop("numel")
            with pytest.raises(ShardClientError) as info:
                c.register_buffer(job_name, BUF, numel, hyper={"lr": 0.1}, **kw)
            assert info.value.code.name == "FAILED_PRECONDITION"
            assert f"{job_name}/{BUF}" in info.value.details
        np.testing.assert_array_equal(c.pull_params(job_name, BUF, 100, 3), np.ones(100))
        assert versions(addresses, job_name) == [3, 3, 3]
    finally:
        c.close()


def test_set_params_with_a_new_version_restores(servers, job_name: str) -> None:
    addresses = [s.address for s in servers(2)]
    numel = 50
    setup_buffer(addresses, job_name, numel, 1)
    c = client(addresses)
    try:
        restored = np.arange(numel, dtype=np.float32)
        c.set_params(job_name, BUF, restored, version=5)
        assert versions(addresses, job_name) == [5, 5]
        np.testing.assert_array_equal(c.pull_params(job_name, BUF, numel, 5), restored)
        # gradients are now taken for step 5, not 0
        replies = c.run(c.push_calls(job_name, BUF, grads(0, numel), 5))
        assert all(r.reduced and not r.duplicate for r in replies)
        with pytest.raises(ShardClientError) as info:
            c.push_grads(job_name, BUF, grads(0, numel), 6)
        assert info.value.code.name == "FAILED_PRECONDITION"
    finally:
        c.close()


def test_pull_times_out_with_deadline_exceeded(servers, job_name: str) -> None:
    addresses = [s.address for s in servers(2)]
    setup_buffer(addresses, job_name, 10, 1)
    c = client(addresses, timeout_s=0.5)
    try:
        began = time.monotonic()
        with pytest.raises(ShardClientError) as info:
            c.pull_params(job_name, BUF, 10, min_version=1)
        assert info.value.code.name == "DEADLINE_EXCEEDED"
        assert 0.4 < time.monotonic() - began < 5.0
    finally:
        c.close()


def test_drop_job(servers, job_name: str) -> None:
    addresses = [s.address for s in servers(2)]
    setup_buffer(addresses, job_name, 10, 1, buffers=("a", "b"))
    c = client(addresses)
    try:
        c.drop_job(job_name)
        assert all(buffer_status(row, job_name, "a") is None for row in statuses(addresses))
        with pytest.raises(ShardClientError) as info:
            c.pull_params(job_name, "a", 10)
        assert info.value.code.name == "NOT_FOUND" and job_name in info.value.details
        c.drop_job(job_name)  # dropping again is fine: NOT_FOUND is ignored
    finally:
        c.close()


def test_drop_job_wakes_waiting_pulls(servers, job_name: str) -> None:
    addresses = [s.address for s in servers(1)]
    setup_buffer(addresses, job_name, 10, 1)
    waiter = client(addresses, timeout_s=2.5)
    c = client(addresses)
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(waiter.pull_params, job_name, BUF, 10, 1)
            time.sleep(0.2)
            assert not pending.done()
            began = time.monotonic()
            c.drop_job(job_name)
            with pytest.raises(ShardClientError) as info:
                pending.result(timeout=10)
            assert time.monotonic() - began < 1.5
            assert info.value.code.name in ("NOT_FOUND", "ABORTED", "FAILED_PRECONDITION")
    finally:
        waiter.close()
        c.close()
