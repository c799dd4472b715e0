"""An elastic rank that is late after pushing its gradient does not abort the others' step
(field review, round 12).

Rank 2 of 3 pushes its gradient of step ``LATE_AT``, then stalls (a long GC pause, a loaded
machine, SIGSTOP) past the join window: the step is applied with its gradient, and the others
train the next steps without it. When it wakes, the server refuses its step's norm ("step 2
is already applied ...; its gradient is gone"). It took that for its own failure and posted
an abort notice: the step the members were training was aborted, and each of them spent a
recovery (4 of 4 runs; a rank late five times used up their ``max_recoveries`` and the job was
lost at the next real failure). Now it resyncs quietly and joins a later step, the members
recover never, and every rank ends equal to single-process training (float64, 1e-9).

Real in-process servers; the ranks are threads running ``train_with_recovery``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from numerics import assert_equivalent
from test_elastic import BATCH, INIT, LR, STEPS, data, net, schedule, single_process

from paramshard.client import ClusterSpec, ShardClient
from paramshard.strategies import (
    FSDPModel,
    FSDPOptimizer,
    ShardingConfiguration,
    train_with_recovery,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.usefixtures("one_torch_thread"),
]
LATE_AT, WINDOW_S, LATE_S, STEP_S, RANKS = 2, 2.0, 5.0, 0.8, 3
"""Rank 2 wakes while the others still train: their steps take STEP_S."""


def run_ranks(addresses: list[str], n: int, run: str, setup, pause=None) -> dict[int, tuple]:
    """``n`` elastic FSDP ranks (threads) training the job of tests/test_elastic.py with
    ``train_with_recovery``; ``setup(r, model, client)`` runs before, ``pause(r, s, model)``
    in each step between its backward and its clipping. Returns rank -> (state, report)."""
    x, y = data(6)
    results: dict[int, tuple] = {}

    def body(r: int) -> None:
        client = ShardClient(ClusterSpec(addresses), rank=r, world_size=n, run_id=run, timeout_s=30)
        config = ShardingConfiguration(client, job=run, elastic=True, join_window_s=WINDOW_S)
        model = FSDPModel(net(INIT), config, wrap=(torch.nn.Linear,))
        opt = FSDPOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), config)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        setup(r, model, client)

        def train_step(s: int) -> float:
            part = model.batch_part(BATCH)
            loss = torch.nn.functional.mse_loss(model(x[s, part]), y[s, part])
            loss.backward()
            if pause is not None:
                pause(r, s, model)
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            return loss.item()

        try:
            report = train_with_recovery(
                model, train_step, STEPS, checkpoint_every=0, wait_s=60, scheduler=sched
            )
            results[r] = (model.state_dict(), report)
        finally:
            client.close()

    threads = [threading.Thread(target=body, args=(r,), name=f"r{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(480)
        assert not t.is_alive(), f"{t.name} still running"
    assert sorted(results) == list(range(n)), results.keys()
    want = single_process(x, y)
    for r, (state, _) in results.items():
        assert_equivalent(state, want, f"rank {r} vs one process")
    return results


@pytest.mark.equivalence
def test_a_rank_late_after_its_push_aborts_nobody(servers) -> None:
    late = [True]

    def pause(r: int, s: int, model) -> None:
        if r == 2 and s == LATE_AT and late[0]:
            late[0] = False
            model.synchronize_gradients()  # its gradient is on the servers
            time.sleep(LATE_S)  # past the join window: the others go on
        time.sleep(STEP_S)

    addresses = [s.address for s in servers(2)]
    results = run_ranks(addresses, RANKS, "late", lambda *_: None, pause)
    for r in (0, 1):
        assert results[r][1].recoveries == 0, results[r]  # nothing aborted their steps
    late_report = results[2][1]
    assert late_report.recoveries == 1, late_report
    assert late_report.causes == ["FAILED_PRECONDITION"], late_report


@pytest.mark.equivalence
def test_an_epoch_aborted_as_training_ends_is_recovered_from(servers) -> None:
    """A notice that aborted rank 0's epoch is there when its last step is done (as when one
    came during its last recovery, after that recovery read the notices: 2 of 11 runs of a
    field review): the servers hold every step, so ``train_with_recovery`` moves it to the next
    epoch before it returns, and the next call (``state_dict()``) works. Before, it failed
    with ABORTED."""
    done, told = threading.Barrier(2), threading.Event()

    def setup(r: int, model, client) -> None:
        real = model.confirm_kept

        def aborted_at_the_end() -> None:
            done.wait(60)  # both ranks trained every step
            if r == 0 and not told.is_set():
                told.set()
                client.run_state.give_up("recovers: a notice as training ends (the test)")
            deadline = time.monotonic() + 10  # rank 1 hears it through its lease
            while client.run_state.current() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert client.run_state.current() is not None
            real()

        model.confirm_kept = aborted_at_the_end

    results = run_ranks([s.address for s in servers(2)], 2, "ends", setup)
    assert told.is_set() and results[0][1].recoveries == 0, results[0][1]
