"""An elastic job's end: a rank that comes as the others finish trains nothing and ends at once.

A rank restarted (or started) late finds the servers at, or training, the last step of the
loop the others run. It must not wait ``elastic_wait_s`` below ``min_world_size`` for ranks
that have finished (the field check's hang: a restarted rank of a finished job held its
launcher for the ten minutes of the default wait, then failed). Building the optimizer joins
no step, and ``train_with_recovery(steps=N)`` stops waiting once the servers applied N steps
(``JoinReply.applied``, server/collectives/membership.py step 3).

Ranks are threads of this process on an in-process server, as in tests/test_elastic.py; the
late rank's ``elastic_wait_s`` is short, so the old behaviour fails here with
``MembershipError`` instead of a hang.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from test_elastic import INIT, LR, net

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.membership import MembershipError
from paramshard.strategies import (
    FSDPModel,
    FSDPOptimizer,
    ShardingConfiguration,
    ZeRO2Model,
    ZeRO2Optimizer,
    train_with_recovery,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

STEPS, BATCH, WORLD = 3, 6, 3
X = torch.randn(STEPS, BATCH, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
Y = torch.randn(STEPS, BATCH, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


def rank(address: str, r: int, strategy: str, out: dict[int, Any], before: Any = None) -> None:
    """Rank ``r`` of an elastic job of at most ``WORLD`` ranks, at least 2 a step, training
    ``STEPS`` steps; ``out[r]``: (state, step count, steps it trained) or the error it met.
    ``before(r, s, model)`` runs at the start of each step it trains."""
    client = ShardClient(ClusterSpec([address]), rank=r, world_size=WORLD, run_id="end")
    try:
        config = ShardingConfiguration(
            client, job="j", elastic=True, min_world_size=2, join_window_s=5.0, elastic_wait_s=3.0
        )
        model_cls, opt_cls = (
            (FSDPModel, FSDPOptimizer) if strategy == "fsdp" else (ZeRO2Model, ZeRO2Optimizer)
        )
        model = model_cls(net(INIT), config)
        opt = opt_cls(torch.optim.AdamW(model.parameters(), lr=LR), config)

        def train_step(s: int) -> float:
            if before is not None:
                before(r, s, model)
            part = model.batch_part(BATCH)
            loss = torch.nn.functional.mse_loss(model(X[s, part]), Y[s, part])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return model.batch_mean(loss.item())

        report = train_with_recovery(model, train_step, STEPS, checkpoint_every=0)
        out[r] = (model.state_dict(), model.step_count, sorted(report.losses))
    except (MembershipError, RuntimeError) as exc:
        out[r] = exc
    finally:
        client.close()


def threads(address: str, ranks: list[int], strategy: str, out: dict, before: Any = None) -> list:
    ts = [
        threading.Thread(target=rank, args=(address, r, strategy, out, before), name=f"r{r}")
        for r in ranks
    ]
    for t in ts:
        t.start()
    return ts


def finish(ts: list[threading.Thread]) -> None:
    for t in ts:
        t.join(240)
        assert not t.is_alive(), f"{t.name} still running"


def assert_same_model(out: dict, late: int) -> None:
    state, count, trained = out[late]
    assert (count, trained) == (STEPS, [])  # at the loop's end, no step of its own
    for name, value in out[0][0].items():
        assert torch.equal(state[name], value), name  # the servers' final model


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_a_rank_after_the_job_ended_trains_nothing_and_returns(servers, strategy) -> None:
    address = servers(1)[0].address
    out: dict[int, Any] = {}
    finish(threads(address, [0, 1], strategy, out))
    assert [out[r][1:] for r in (0, 1)] == [(STEPS, list(range(STEPS)))] * 2
    finish(threads(address, [2], strategy, out))  # alone, below min_world_size
    assert not isinstance(out[2], Exception), out[2]
    assert_same_model(out, 2)


def test_a_rank_that_comes_during_the_last_step_returns_once_it_is_applied(servers) -> None:
    """Rank 2 starts while the last step trains and asks to join the step after it (past the
    loop's end); ranks 0 and 1 finish that step only once the coordinator lists rank 2 as
    waiting, so every run takes this path."""
    address = servers(1)[0].address
    out: dict[int, Any] = {}
    late: list[threading.Thread] = []
    coordinator = ShardClient(ClusterSpec([address]))

    def before(r: int, s: int, model: Any) -> None:
        if s == STEPS - 1 and r == 0:
            late.extend(threads(address, [2], "fsdp", out))
            deadline = time.monotonic() + 120
            while 2 not in waiting(coordinator):
                assert time.monotonic() < deadline, "rank 2 never waited to join"
                time.sleep(0.05)

    try:
        finish(threads(address, [0, 1], "fsdp", out, before))
        finish(late)
    finally:
        coordinator.close()
    assert [out[r][1:] for r in (0, 1)] == [(STEPS, list(range(STEPS)))] * 2
    assert not isinstance(out[2], Exception), out[2]
    assert_same_model(out, 2)


def waiting(client: ShardClient) -> list[int]:
    rows = [m for m in client.status()[0]["memberships"] if m["job"] == "j"]
    return rows[0].get("waiting", []) if rows else []
