"""``should_stop`` is asked again after a recovery, in an elastic job as in a fixed-world one,
and ``train_with_recovery`` does not return while a server lost the job after its last update
(strategies/elastic_training.py, strategies/recovery.py).

Server 1 is killed while the ranks decide whether to stop after step ``STOP_AT``, and started
again, empty, at its address. Either the decision's all-reduces fail (the server is down) or
they complete on the new process, retried there (a collective needs no job on a server). Either
way the ranks recover from the neighbour replicas at ``STOP_AT + 1`` (nothing replayed), are
asked about ``STOP_AT`` again, and stop there, equal to single-process training of ``STOP_AT +
1`` steps (float64, 1e-9). Before, an elastic recovery skipped the question and the job trained
on to ``STEPS``; and where the all-reduces completed on the new process, training ended at once
with server 1 empty (the next ``state_dict()`` failed with NOT_FOUND; 2 of 4 runs here).

Servers are real ``paramshard serve`` processes (tests/server_processes.py);
the ranks are threads running ``train_with_recovery`` on an FSDP model.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
import torch
from numerics import assert_equivalent
from server_processes import killer
from test_elastic import BATCH, INIT, LR, STEPS, data, net, schedule, single_process
from test_recovery import cluster, cluster_of, wait_for_replica  # noqa: F401

from paramshard.client import ClusterSpec, ShardClient
from paramshard.strategies import (
    FSDPModel,
    FSDPOptimizer,
    ShardingConfiguration,
    train_with_recovery,
)

pytestmark = [
    pytest.mark.faults,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.usefixtures("one_torch_thread"),
]
STOP_AT, RANKS = 4, 2


@pytest.mark.equivalence
@pytest.mark.parametrize("elastic", [True, False], ids=["elastic", "fixed-world"])
def test_a_decision_cut_short_by_a_server_loss_is_asked_again(
    cluster,  # noqa: F811 - the fixture imported above: 2 serve processes
    elastic,
) -> None:
    x, y = data(5)
    addresses = [s.address for s in cluster]
    kill_server_1, killed, restarted = killer(cluster[1], STOP_AT)
    asked: defaultdict[int, list] = defaultdict(list)  # rank -> its answers about STOP_AT
    arrived, after_kill = threading.Barrier(RANKS), threading.Barrier(RANKS)
    results: dict[int, tuple] = {}

    def body(r: int) -> None:
        client = ShardClient(
            ClusterSpec(addresses), rank=r, world_size=RANKS, run_id="stop", timeout_s=30
        )
        config = ShardingConfiguration(
            client, job="es", elastic=elastic, join_window_s=20.0, replicate_every=1
        )
        model = FSDPModel(net(INIT), config, wrap=(torch.nn.Linear,))
        opt = FSDPOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), config)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)

        def train_step(s: int) -> float:
            part = model.batch_part(BATCH)
            loss = torch.nn.functional.mse_loss(model(x[s, part]), y[s, part])
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            return loss.item()

        def should_stop(step: int, loss: float) -> bool:
            """Stops after STOP_AT once the ranks agree on its mean loss; server 1 dies before
            the first ask's two all-reduces (one meets it)."""
            if step != STOP_AT:
                return False
            asked[r].append(None)
            if len(asked[r]) == 1:
                arrived.wait(timeout=60)  # every rank is through the step
                if r == 0:
                    wait_for_replica(client, "es", 1, STOP_AT + 1)  # nothing to replay
                    kill_server_1(STOP_AT)
                after_kill.wait(timeout=60)
            value = torch.tensor([loss], dtype=torch.float64)
            mean = float(client.all_reduce(value, "mean")[0])
            asked[r][-1] = (mean, float(client.all_reduce(value, "sum")[0]))
            return True

        try:
            report = train_with_recovery(
                model, train_step, STEPS, wait_s=60, scheduler=sched, should_stop=should_stop
            )
            results[r] = (model.state_dict(), report, model.step_count)
        finally:
            client.close()

    ranks = [threading.Thread(target=body, args=(r,), name=f"r{r}") for r in range(RANKS)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(480)
        assert not t.is_alive(), f"{t.name} still running"
    assert killed.is_set() and restarted, "the server was not killed and restarted"
    assert sorted(results) == list(range(RANKS)), results.keys()
    want = single_process(x, y, steps=STOP_AT + 1)
    for r, (state, report, step_count) in results.items():
        assert report.recoveries == 1 and report.replayed_steps == 0, report
        assert step_count == STOP_AT + 1 and report.stopped_early, (step_count, report)
        # the first ask was cut short (None) or completed on the restarted server; asked again
        assert len(asked[r]) == 2 and asked[r][1] is not None, asked
        assert_equivalent(state, want, f"rank {r} vs {STOP_AT + 1} steps in one process")
