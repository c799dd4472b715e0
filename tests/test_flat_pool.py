"""Flat gradients reused from one push to the next (strategies/data_parallel/flat_pool.py):
the pool on its own, then ZeRO-2 and FSDP training with it against whole-batch float64
training, the flats reused within a step (micro-batches) and across steps."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from numerics import assert_equivalent
from strategy_world import (
    addrs_fixture,  # noqa: F401 - the module's servers: ``addrs``
    init_state,
    rank_data,
    reference,
    train_accumulated,
    world,
)

from paramshard.strategies.data_parallel.flat_pool import FlatPool


def test_a_flat_given_back_is_the_next_take_of_its_size_and_dtype() -> None:
    pool = FlatPool(max_idle_bytes=1_000)
    a = pool.take(10, torch.float32, "cpu")
    pool.give(a)
    assert pool.idle_bytes == 40
    assert pool.take(10, torch.float64, "cpu").data_ptr() != a.data_ptr()  # another dtype
    assert pool.take(11, torch.float32, "cpu").data_ptr() != a.data_ptr()  # another size
    assert pool.reused == 0
    b = pool.take(10, torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr() and pool.reused == 1 and pool.idle_bytes == 0
    c = pool.take(10, torch.float32, "cpu")  # nothing idle: new memory
    assert c.data_ptr() != b.data_ptr()


def test_idle_flats_stay_within_the_bound() -> None:
    pool = FlatPool(max_idle_bytes=100)
    flats = [pool.take(10, torch.float32, "cpu") for _ in range(3)]  # 40 bytes each
    for t in flats:
        pool.give(t)
    assert pool.idle_bytes == 80  # the third would pass 100: dropped
    kept = {pool.take(10, torch.float32, "cpu").data_ptr() for _ in range(2)}
    assert kept == {flats[0].data_ptr(), flats[1].data_ptr()}
    pool.give(flats[0])
    pool.clear()
    assert pool.idle_bytes == 0
    assert pool.take(10, torch.float32, "cpu").data_ptr() != flats[0].data_ptr()
    nothing = FlatPool()  # the default bound keeps none
    nothing.give(nothing.take(4, torch.float32, "cpu"))
    assert nothing.idle_bytes == 0


def test_device_flats_are_left_to_their_allocator() -> None:
    """Only host flats are kept (CUDA's caching allocator orders reuse by stream); the meta
    device stands in for one here."""
    pool = FlatPool(max_idle_bytes=1_000)
    t = pool.take(10, torch.float32, "meta")
    assert t.device.type == "meta"
    pool.give(t)
    assert pool.idle_bytes == 0


@pytest.mark.equivalence
@pytest.mark.parametrize("kind", ["zero2", "fsdp"])
def test_training_with_reused_flats_matches_whole_batch(
    kind: str, run_ranks: Any, addrs: list[str]
) -> None:
    """Three steps of two micro-batches each: every push after the first few takes a flat a
    finished push gave back, and the parameters match single-process float64 training. Each
    push starts 20 ms late, so the training thread flattens the next bucket or unit while the
    last is in flight: a flat handed out again before its push ended would send the wrong
    gradient."""
    init = init_state()
    want = reference(init, 3)
    # small buckets (ZeRO-2) so that a step has several flats of one size to pass around
    conf = {"bucket_size_bytes": 2**14} if kind == "zero2" else {}

    def fn(client: Any, model: Any, opt: Any, ref: Any) -> None:
        run = client.run

        def late_pushes(calls: Any, *args: Any, **kwargs: Any) -> Any:
            calls = list(calls)  # an iterable, read once
            if any(c.method == "PushGrad" for c in calls):
                time.sleep(0.02)
            return run(calls, *args, **kwargs)

        client.run = late_pushes
        x, y = rank_data(client.rank)
        train_accumulated(model, opt, x, y, 3)
        assert_equivalent(model.get_parameters(), want, f"{kind} with reused flats")
        pool = model._flats
        assert pool.reused > 0
        assert 0 < pool.max_idle_bytes and pool.idle_bytes <= pool.max_idle_bytes

    world(run_ranks, addrs, kind, fn, init=init, gradient_accumulation_steps=2, **conf)
