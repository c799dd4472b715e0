"""An elastic job loses a server and a trainer in the same run, takes a new trainer, and ends
where single-process training on the same global batches ends (float64, 1e-9).

Servers are real ``paramshard serve`` processes (tests/server_processes.py);
the ranks are threads running ``train_with_recovery`` on an elastic FSDP model with neighbour
replicas every step (or snapshots every 4 steps). Rank 2 leaves at step 3 (it raises, as a
``LocalCluster`` rank would), server ``killed`` is SIGKILLed when step 6 begins and started
empty at its address (the ranks hold a recovery round: one restores, the others wait), and
rank 3 joins at step 9. This is the combination the fixed-world design refuses: trainer
restarts and ``train_with_recovery`` together.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from numerics import assert_equivalent
from server_processes import ServerProcess, killer
from test_elastic import BATCH, INIT, LR, STEPS, data, net, schedule, single_process, vanish

from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.server.collectives.membership import POLL_S
from paramshard.strategies import (
    FSDPModel,
    FSDPOptimizer,
    ShardingConfiguration,
    train_with_recovery,
)

pytestmark = [
    pytest.mark.faults,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.usefixtures("one_torch_thread"),
]
LEAVES, KILL_AT, JOINS = 3, 6, 9


@pytest.fixture
def server_processes(tmp_path):
    started = [ServerProcess(tmp_path / "snapshots") for _ in range(2)]
    for s in started:
        s.start()
    yield started
    for s in started:
        s.stop()


@pytest.mark.equivalence
@pytest.mark.parametrize(
    ("killed", "replicate_every", "lost_in_recovery"),
    [(1, 1, False), (0, 1, False), (1, 0, False), (1, 1, True)],
    ids=["server1-replicas", "coordinator-replicas", "server1-snapshots", "rank-lost-in-recovery"],
)
def test_trainer_leaves_server_dies_trainer_joins(
    server_processes, killed, replicate_every, lost_in_recovery
) -> None:
    """``lost_in_recovery``: rank 2 does not leave at step 3 but dies as its recovery from
    the server's loss begins, before it announces itself in the recovery round: the others,
    waiting in that round, get the abort notice of its loss and must recover again, in a new
    epoch (strategies/recovery_rounds.py). Before, that second failure left
    ``train_with_recovery``: every rank in the round failed (a field check: 2 runs of 7)."""
    x, y = data(4)
    want = single_process(x, y)
    addresses = [s.address for s in server_processes]
    on_step, was_killed, restarted = killer(server_processes[killed], KILL_AT)
    results: dict[int, object] = {}
    lost = threading.Event()  # rank 2 died in its recovery
    joiner = threading.Thread(target=lambda: body(3), name="r3")

    def body(r: int) -> None:
        client = ShardClient(
            ClusterSpec(addresses), rank=r, world_size=4, run_id="rec", timeout_s=30, retries=3
        )
        config = ShardingConfiguration(
            client, job="er", elastic=True, join_window_s=20.0, replicate_every=replicate_every
        )
        model = FSDPModel(net(INIT), config, wrap=(torch.nn.Linear,))
        opt = FSDPOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), config)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        if r == 2 and lost_in_recovery:

            def announce(epoch: int) -> None:
                try:
                    model.membership.recovery(epoch)
                except ShardClientError:  # its channels closed as it died
                    pass

            def dies(epoch: int, settle_s: float) -> int:
                """Announces itself in the recovery round, then dies (no goodbye)."""
                threading.Thread(target=announce, args=(epoch,), daemon=True).start()
                time.sleep(0.5)
                vanish(client)
                lost.set()
                raise SystemExit

            model.resync = dies
        if r == 0 and lost_in_recovery:  # the round's leader: it says "done" once rank 2 is lost
            recovered = model.membership.recovered

            def after_the_loss() -> None:
                lost.wait(60)
                deadline = time.monotonic() + 30
                while client.run_state.current() is None and time.monotonic() < deadline:
                    time.sleep(0.05)  # the servers' notice of rank 2's loss
                time.sleep(POLL_S + 1)  # rank 1's Join answers "not yet" after the notice
                recovered()

            model.membership.recovered = after_the_loss

        def train_step(s: int) -> float:
            if r == 0:
                on_step(s)
                if s == JOINS - 1 and not joiner.ident:  # rank 3 joins at step 9
                    joiner.start()
                    wait_listed(client, 3)
            part = model.batch_part(BATCH)
            if r == 2 and s == LEAVES and not lost_in_recovery:
                raise RuntimeError("rank 2 leaves")
            loss = torch.nn.functional.mse_loss(model(x[s, part]), y[s, part])
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            return loss.item()

        every = 0 if replicate_every else 4
        try:
            report = train_with_recovery(
                model, train_step, STEPS, checkpoint_every=every, wait_s=60, scheduler=sched
            )
            results[r] = (model.state_dict(), report)
        except RuntimeError:
            model.leave("it raised")
        except SystemExit:
            return
        finally:
            client.close()

    ranks = [threading.Thread(target=body, args=(r,), name=f"r{r}") for r in range(3)]
    for t in ranks:
        t.start()
    for t in [*ranks, joiner]:
        deadline = time.monotonic() + 600
        while t is joiner and not t.ident and time.monotonic() < deadline:
            time.sleep(0.05)
        t.join(max(0.0, deadline - time.monotonic()))
        assert not t.is_alive(), f"{t.name} still running"
    assert was_killed.is_set() and restarted, "the server was not killed and restarted"
    assert sorted(results) == [0, 1, 3]
    for r, (state, _) in results.items():
        assert_equivalent(state, want, f"rank {r} vs one process")
    recovered = results[0][1]
    print(
        f"server {killed} killed ({'replicas' if replicate_every else 'snapshots'}): rank 0"
        f" recovered {recovered.recoveries} times, causes {recovered.causes}, resumed at"
        f" {recovered.resumed_at} (server restart {restarted[0]:.1f} s)"
    )


def wait_listed(client: ShardClient, rank: int) -> None:
    """Until the coordinator lists ``rank`` waiting to join a step (at most 120 s)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rows = [m for m in client.status()[0].get("memberships", []) if m["job"] == "er"]
        if rows and rank in rows[0].get("waiting", []):
            return
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never waited to join")
