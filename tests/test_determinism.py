"""Reproducibility: two identical runs give bitwise identical losses and parameters.

The servers reduce contributions in rank order (micro-batch order within a rank) whatever order
they arrive in (``ShardingConfiguration(deterministic=True)``, the default). These runs are
float32 on purpose: float64 would hide most of a reordering's effect below the comparisons of
other tests, float32 shows it in the last bits, and bitwise equality asks for exactly none.
W = 3 data-parallel contributors: with two, a + b == b + a and no order could show.

Each pair of runs differs only in when the ranks start their steps (random sleeps of up to a
few milliseconds, another seed per run), so contributions arrive in other orders. Ranks are
threads sharing torch's global RNG: nothing here draws from it after the initial weights (no
dropout). ``deterministic=False`` (sum in arrival order) must still train correctly: float64
against single-process at the usual 1e-9.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from numerics import assert_equivalent
from test_hybrid import train_hybrid
from test_strategies import STRATEGIES, batches, initial_state, train_sharded, train_single

pytestmark = [pytest.mark.equivalence, pytest.mark.usefixtures("one_torch_thread")]

W = 3


def jitter(seed: int, max_s: float = 0.003):
    """An ``on_step(rank, step)`` sleeping a random 0..max_s, differently for every seed."""
    lock = threading.Lock()
    rng = random.Random(seed)

    def on_step(rank: int, step: int) -> None:
        with lock:
            pause = rng.uniform(0.0, max_s)
        time.sleep(pause)

    return on_step


def assert_bitwise(first: list, second: list, what: str) -> None:
    """Every rank's (losses, state dict, ...) identical between the runs, bit for bit."""
    assert len(first) == len(second)
    for r, (a, b) in enumerate(zip(first, second, strict=True)):
        losses_a, state_a, losses_b, state_b = a[0], a[1], b[0], b[1]
        assert losses_a == losses_b, f"{what} rank {r}: losses differ: {losses_a} vs {losses_b}"
        assert list(state_a) == list(state_b)
        for name, value in state_a.items():
            assert value.dtype == torch.float32, (what, name)
            diff = float((value - state_b[name]).abs().max())
            assert torch.equal(value, state_b[name]), f"{what} rank {r}: {name} ({diff:.2e})"


@pytest.fixture(scope="module")
def float32_setup():
    return initial_state(torch.float32), batches()


@pytest.mark.parametrize("local_calls", [True, False], ids=["in-process", "over-the-wire"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_two_data_parallel_runs_are_bitwise_identical(float32_setup, strategy, local_calls):
    init, data = float32_setup
    runs = [
        train_sharded(
            strategy, "adamw", W, W, init, data, local_calls=local_calls, on_step=jitter(seed)
        )
        for seed in (1, 2)
    ]
    assert_bitwise(*runs, f"{strategy} W={W}")
    # and the ranks agree with each other
    assert_bitwise(runs[0][:1] * W, runs[0], f"{strategy} rank 0 vs the others")


def test_two_hybrid_runs_are_bitwise_identical(float32_setup):
    """Pipeline and data parallelism together, (pp, tp, dp) = (2, 1, 3): three contributors
    to every ZeRO part, two micro-batches each, a cross-stage norm for clipping."""
    from test_hybrid import BATCH as HYBRID_BATCH
    from test_hybrid import STEPS as HYBRID_STEPS
    from test_hybrid import initial_state as hybrid_initial_state
    from test_hybrid import sgd

    init = hybrid_initial_state(dtype=torch.float32)
    shape = (HYBRID_STEPS, HYBRID_BATCH, 17)  # dp = 3 takes 2 rows each, one per micro-batch
    data = torch.randint(0, 50, shape, generator=torch.Generator().manual_seed(1))
    runs = [
        train_hybrid(
            2, 1, 3, init, data, servers=3, max_norm=0.3, make_opt=sgd, on_step=jitter(seed)
        )
        for seed in (1, 2)
    ]
    first, second = ([(res[0], res[1]) for res in run] for run in runs)
    assert_bitwise(first, second, "hybrid (2, 1, 3)")
    for a, b in zip(runs[0], runs[1], strict=True):
        assert a[3] == b[3]  # the clipped norms too


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_arrival_order_reduction_still_trains_correctly(strategy):
    """``deterministic=False``: contributions summed as they arrive. Not reproducible bit for
    bit, but still single-process training: float64 within 1e-9."""
    init, data = initial_state(), batches()
    want_losses, want_state = train_single("adamw", init, data)
    results = train_sharded(
        strategy, "adamw", W, W, init, data, on_step=jitter(3), deterministic=False
    )
    for r, (losses, state) in enumerate(results):
        assert_equivalent(losses, want_losses, f"{strategy} arrival order rank {r} losses")
        assert_equivalent(state, want_state, f"{strategy} arrival order rank {r}")
