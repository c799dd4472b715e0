"""The flat-buffer API's gradients and steps: pushes counted exactly once, versions, gradient
accumulation, half-precision gradients, norms and clipping, concurrent pushers. Helpers as in
test_buffers.py.

Every test runs over each ``transport`` (conftest.py): in-process calls, gRPC with payloads in
shared segments, and gRPC with payloads in-band."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import numpy as np
import pytest
import torch
from test_buffers import (
    BUF,
    TOL,
    average,
    buffer_status,
    client,
    grads,
    initial,
    setup_buffer,
    sgd,
    statuses,
    versions,
)

from paramshard.client import ParamInfo, ShardClient, ShardClientError, StepArgs

pytestmark = pytest.mark.usefixtures("transport")


@pytest.mark.parametrize("auto_step", [False, True], ids=["explicit-step", "step-args"])
def test_every_push_twice_counts_once(servers, run_ranks, job_name: str, auto_step: bool) -> None:
    world, numel, lr = 3, 1000, 0.5
    addresses = [s.address for s in servers(3)]
    params = setup_buffer(addresses, job_name, numel, world)[BUF]
    args = StepArgs({"lr": lr})

    def rank(c: ShardClient) -> tuple[list, list]:
        g = grads(c.rank, numel)
        kw = {"step_args": args} if auto_step else {}
        first = c.run(c.push_calls(job_name, BUF, g, 0, **kw))
        second = c.run(c.push_calls(job_name, BUF, g, 0, **kw))  # a retry of every message
        if not auto_step:
            c.step(job_name, 0, {BUF: args})  # every rank: the first wins, the rest are acks
        return first, second

    results = run_ranks(rank, world, addresses)
    for first, second in results:
        assert all(r.duplicate for r in second)
        assert not any(r.duplicate for r in first)
    c = client(addresses)
    try:
        got = c.pull_params(job_name, BUF, numel, min_version=1)
        want = sgd(params, average([grads(r, numel) for r in range(world)]), lr)
        np.testing.assert_allclose(got, want, **TOL)
        assert versions(addresses, job_name) == [1, 1, 1]
        # a retry arriving after the step is still acknowledged as a duplicate, changing nothing
        late = c.run(c.push_calls(job_name, BUF, grads(0, numel), 0))
        assert all(r.duplicate for r in late)
        np.testing.assert_array_equal(c.pull_params(job_name, BUF, numel), got)
    finally:
        c.close()


def test_steps_versions_and_changing_lr(servers, run_ranks, job_name: str) -> None:
    """Scheduler-like: the lr travels with every step's pushes; versions count the steps."""
    world, numel, steps = 2, 1001, 4
    lrs = [0.1 * 0.5**s for s in range(steps)]
    addresses = [s.address for s in servers(3)]
    params = setup_buffer(addresses, job_name, numel, world)[BUF]

    def rank(c: ShardClient) -> list[np.ndarray]:
        seen = []
        for s in range(steps):
            c.push_grads(
                job_name, BUF, grads(c.rank, numel, s), s, step_args=StepArgs({"lr": lrs[s]})
            )
            seen.append(c.pull_params(job_name, BUF, numel, min_version=s + 1))
        return seen

    results = run_ranks(rank, world, addresses)
    want = params
    for s in range(steps):
        want = sgd(want, average([grads(r, numel, s) for r in range(world)]), lrs[s])
        for r in range(world):
            np.testing.assert_allclose(results[r][s], want, **TOL, err_msg=f"step {s}")
    assert versions(addresses, job_name) == [steps] * 3
    lr_now = [buffer_status(row, job_name)["hyper"]["lr"] for row in statuses(addresses)]
    assert lr_now == [pytest.approx(lrs[-1])] * 3


def test_pull_waits_until_the_step_lands(servers, run_ranks, job_name: str) -> None:
    world, numel, lr = 2, 300, 0.25
    addresses = [s.address for s in servers(2)]
    params = setup_buffer(addresses, job_name, numel, world)[BUF]
    waiter = client(addresses, timeout_s=15)
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(waiter.pull_params, job_name, BUF, numel, 1)
            time.sleep(0.2)
            assert not pending.done()  # version 1 does not exist yet
            run_ranks(
                lambda c: c.push_grads(
                    job_name, BUF, grads(c.rank, numel), 0, step_args=StepArgs({"lr": lr})
                ),
                world,
                addresses,
            )
            got = pending.result(timeout=15)
        want = sgd(params, average([grads(r, numel) for r in range(world)]), lr)
        np.testing.assert_allclose(got, want, **TOL)
    finally:
        waiter.close()


def test_gradient_accumulation_sums_micro_batches(servers, run_ranks, job_name: str) -> None:
    world, numel, lr = 2, 501, 0.5
    addresses = [s.address for s in servers(2)]
    params = setup_buffer(addresses, job_name, numel, world)[BUF]
    args = StepArgs({"lr": lr})

    def micro(m: int):
        def push(c: ShardClient) -> None:
            c.push_grads(
                job_name, BUF, grads(c.rank, numel, 0, m), 0, micro=m, num_micro=2, step_args=args
            )

        return push

    run_ranks(micro(0), world, addresses)
    assert versions(addresses, job_name) == [0, 0]  # half the micro-batches: no step yet
    run_ranks(micro(1), world, addresses)
    per_rank = [grads(r, numel, 0, 0) + grads(r, numel, 0, 1) for r in range(world)]
    want = sgd(params, average(per_rank), lr)  # micro-batches summed, contributors averaged
    c = client(addresses)
    try:
        np.testing.assert_allclose(c.pull_params(job_name, BUF, numel, 1), want, **TOL)
    finally:
        c.close()
    assert versions(addresses, job_name) == [1, 1]


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_half_precision_gradients(servers, run_ranks, job_name: str, wire: str) -> None:
    world, numel, lr = 2, 640, 0.5
    addresses = [s.address for s in servers(2)]
    params = setup_buffer(addresses, job_name, numel, world)[BUF]

    def rough(rank: int) -> np.ndarray:  # not representable in 16 bits: the client rounds
        return np.random.default_rng(rank).standard_normal(numel).astype(np.float32)

    run_ranks(
        lambda c: c.push_grads(
            job_name, BUF, rough(c.rank), 0, dtype=wire, step_args=StepArgs({"lr": lr})
        ),
        world,
        addresses,
    )
    if wire == "bfloat16":
        rounded = [
            torch.from_numpy(rough(r)).to(torch.bfloat16).float().numpy() for r in range(world)
        ]
    else:
        rounded = [rough(r).astype(np.float16).astype(np.float32) for r in range(world)]
    want = sgd(params, average(rounded), lr)
    c = client(addresses)
    try:
        np.testing.assert_allclose(c.pull_params(job_name, BUF, numel, 1), want, **TOL)
    finally:
        c.close()


def test_grad_sum_squares_over_servers(servers, run_ranks, job_name: str) -> None:
    world, numel = 2, 1001
    addresses = [s.address for s in servers(3)]
    setup_buffer(addresses, job_name, numel, world, buffers=("a", "b"))

    def rank(c: ShardClient) -> list[float]:
        c.run(
            c.push_calls(job_name, "a", grads(c.rank, numel), 0)
            + c.push_calls(job_name, "b", 3 * grads(c.rank, numel), 0)
        )
        return c.grad_sum_squares(job_name, ["a", "b"], 0)

    results = run_ranks(rank, world, addresses)
    g = average([grads(r, numel) for r in range(world)]).astype(np.float64)
    want = [float(g @ g), float(9 * g @ g)]
    for got in results:
        assert got == pytest.approx(want, rel=1e-5)
    assert versions(addresses, job_name, "a") == [0, 0, 0]  # no step without step args


def test_sum_squares_of_a_large_float32_slice_is_added_in_float64(servers, job_name: str) -> None:
    """A float32 slice's sum of squares was one float32 dot: 4.2e-4 off for GPT-2 124M's
    62M-element slices (clipping there used a norm 7.7x further from float64's than torch's
    own float32 norm). Added in float64 now (server/runtime/backend.py's sum_squares): what
    is left is the float64 sum's round-off."""
    numel = 1 << 23  # float32's dot: ~2e-5 off here
    addresses = [s.address for s in servers(1)]
    g = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    c = client(addresses, 0, 1)
    try:
        params = [ParamInfo("w", (numel,), 0)]
        c.register_buffer(job_name, BUF, numel, params=params, optimizer="sgd", hyper={"lr": 0.1})
        c.set_params(job_name, BUF, np.zeros(numel, np.float32))
        c.run(c.push_calls(job_name, BUF, g, 0))
        (got,) = c.grad_sum_squares(job_name, [BUF], 0)
        (per,) = c.param_sum_squares(job_name, {BUF: 1}, 0)[BUF]
    finally:
        c.close()
    want = float(np.dot(g.astype(np.float64), g.astype(np.float64)))
    assert abs(got - want) <= 1e-10 * want and abs(per - want) <= 1e-10 * want, (got, per, want)


def test_per_parameter_sum_squares_kept_after_the_step(servers, run_ranks, job_name: str) -> None:
    """GradNorm per_param: each registered parameter's part, summed over the servers (a
    parameter may straddle two slices), and still there for a rank asking after the step."""
    world, numel = 2, 1001
    addresses = [s.address for s in servers(3)]  # slices 334/334/333: "w" straddles two
    params = [ParamInfo("w", (20, 20), 0), ParamInfo("b", (1,), 400), ParamInfo("v", (600,), 401)]
    c0 = client(addresses, 0, world)
    try:
        c0.register_buffer(job_name, BUF, numel, params=params, optimizer="sgd", hyper={"lr": 0.1})
        c0.set_params(job_name, BUF, initial(numel))
    finally:
        c0.close()

    def rank(c: ShardClient) -> tuple[dict, dict]:
        c.run(c.push_calls(job_name, BUF, grads(c.rank, numel), 0))
        before = c.param_sum_squares(job_name, {BUF: 3}, 0)
        c.step(job_name, 0, {BUF: StepArgs({"lr": 0.1})})
        return before, c.param_sum_squares(job_name, {BUF: 3}, 0)

    g = average([grads(r, numel) for r in range(world)]).astype(np.float64)
    want = [float(g[:400] @ g[:400]), float(g[400] ** 2), float(g[401:] @ g[401:])]
    for before, after in run_ranks(rank, world, addresses):
        assert before[BUF] == pytest.approx(want, rel=1e-5)
        assert after == before


def test_clipped_step_and_repeated_step_is_idempotent(servers, run_ranks, job_name: str) -> None:
    world, numel, lr, max_norm = 2, 1001, 0.5, 1.0
    addresses = [s.address for s in servers(3)]
    init = setup_buffer(addresses, job_name, numel, world, buffers=("a", "b"))

    def rank(c: ShardClient) -> float:
        c.run(
            c.push_calls(job_name, "a", grads(c.rank, numel), 0)
            + c.push_calls(job_name, "b", 3 * grads(c.rank, numel), 0)
        )
        norm = float(np.sqrt(sum(c.grad_sum_squares(job_name, ["a", "b"], 0))))
        coef = min(1.0, max_norm / (norm + 1e-6))
        c.step(job_name, 0, {b: StepArgs({"lr": lr}, clip_coef=coef) for b in ("a", "b")})
        return coef

    coefs = run_ranks(rank, world, addresses)
    assert coefs[0] == coefs[1] < 1.0  # the gradient really is clipped
    g = average([grads(r, numel) for r in range(world)])
    c = client(addresses)
    try:
        got_a = c.pull_params(job_name, "a", numel, 1)
        got_b = c.pull_params(job_name, "b", numel, 1)
        np.testing.assert_allclose(got_a, sgd(init["a"], g * np.float32(coefs[0]), lr), **TOL)
        np.testing.assert_allclose(
            got_b, sgd(init["b"], 3 * g * np.float32(coefs[0]), lr), rtol=1e-6, atol=1e-6
        )
        # a late Step for the applied step (even with other arguments) is acknowledged only
        c.step(job_name, 0, {b: StepArgs({"lr": 10.0}, clip_coef=0.5) for b in ("a", "b")})
        np.testing.assert_array_equal(c.pull_params(job_name, "a", numel), got_a)
        np.testing.assert_array_equal(c.pull_params(job_name, "b", numel), got_b)
        assert versions(addresses, job_name, "a") == [1, 1, 1]
    finally:
        c.close()


def test_concurrent_pushers(servers, run_ranks, job_name: str) -> None:
    """Four ranks pushing two buffers in small chunks at once, for three steps."""
    world, numel, steps, lr = 4, 3001, 3, 0.125
    addresses = [s.address for s in servers(3)]
    init = setup_buffer(addresses, job_name, numel, world, buffers=("a", "b"))

    def rank(c: ShardClient) -> None:
        for s in range(steps):
            args = StepArgs({"lr": lr})
            c.run(
                c.push_calls(job_name, "a", grads(c.rank, numel, s), s, step_args=args)
                + c.push_calls(job_name, "b", -grads(c.rank, numel, s), s, step_args=args)
            )
            c.run(
                c.pull_calls(job_name, "a", np.empty(numel, np.float32), s + 1)
                + c.pull_calls(job_name, "b", np.empty(numel, np.float32), s + 1)
            )

    run_ranks(rank, world, addresses, chunk_bytes=1024, max_in_flight=4)
    want_a, want_b = init["a"], init["b"]
    for s in range(steps):
        g = average([grads(r, numel, s) for r in range(world)])
        want_a, want_b = sgd(want_a, g, lr), sgd(want_b, -g, lr)
    c = client(addresses)
    try:
        np.testing.assert_allclose(c.pull_params(job_name, "a", numel, steps), want_a, **TOL)
        np.testing.assert_allclose(c.pull_params(job_name, "b", numel, steps), want_b, **TOL)
    finally:
        c.close()


def test_concurrent_pushes_without_steps_sum_exactly(servers, job_name: str) -> None:
    """Eight threads, each its own client and contributor, racing on the same slices."""
    world, numel = 8, 2049
    addresses = [s.address for s in servers(2)]
    setup_buffer(addresses, job_name, numel, world)
    barrier = threading.Barrier(world)

    def push(rank: int) -> list[float]:
        c = client(addresses, rank, world, chunk_bytes=512)
        try:
            barrier.wait(10)
            c.push_grads(job_name, BUF, grads(rank, numel), 0)
            c.push_grads(job_name, BUF, grads(rank, numel), 0)
            return c.grad_sum_squares(job_name, [BUF], 0)
        finally:
            c.close()

    with cf.ThreadPoolExecutor(world) as pool:
        results = list(pool.map(push, range(world), timeout=60))
    g = average([grads(r, numel) for r in range(world)]).astype(np.float64)
    assert all(r == pytest.approx([float(g @ g)], rel=1e-6) for r in results)


def test_buffer_smaller_than_the_number_of_servers(servers, job_name: str) -> None:
    addresses = [s.address for s in servers(3)]
    numel = 2  # slices of 1, 1 and 0 elements
    setup_buffer(addresses, job_name, numel, 1)
    c = client(addresses, timeout_s=2)
    try:
        g = np.array([3.0, 4.0], dtype=np.float32)
        c.push_grads(job_name, BUF, g, 0)
        assert c.grad_sum_squares(job_name, [BUF], 0) == [25.0]
    finally:
        c.close()


def test_grad_norm_waiting_through_a_restore(servers, job_name: str) -> None:
    addresses = [s.address for s in servers(1)]
    setup_buffer(addresses, job_name, 10, 1)
    waiter = client(addresses, timeout_s=2.5)
    c = client(addresses)
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(waiter.grad_sum_squares, job_name, [BUF], 0)
            time.sleep(0.2)
            c.set_params(job_name, BUF, np.ones(10, np.float32), version=5)  # a restore
            with pytest.raises(ShardClientError) as info:
                pending.result(timeout=10)
        assert info.value.code.name == "FAILED_PRECONDITION"
    finally:
        waiter.close()
        c.close()
