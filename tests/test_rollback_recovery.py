"""A recovery after a rollback restores the history the job is on, not the one it left (field
review, round 12). Run 1 trains history A to step 10 (snapshots a-0, a-5, a-10); run 2 rolls
the job back (``load_checkpoint("a-5")``) and trains history B with ``train_with_recovery``;
server 1 is SIGKILLed and started again, empty, at step ``kill_at``.

- at step 8, after B's snapshots b-6 and b-8: the recovery restores b-8. "latest" was the
  highest version, a-10: the recovery resumed at step 10 of history A, steps 8 and 9 of B were
  never trained, and the model ended on the history given up, without a word. "latest" is now
  the snapshot taken last (protos/manifest.py ``taken_order``).
- at step 5, the first step after the load, before B took any snapshot: the recovery restores
  a-5, the tag loaded (``tools.recovery_tag``); the snapshot taken last is a-10 then.

Either way run 2 ends equal to single-process training of A's first 5 steps and B's next 5
(float64, 1e-9). Real ``paramshard serve`` processes; ranks are threads (tests/test_recovery.py).
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from numerics import assert_equivalent
from server_processes import killer
from test_recovery import W, cluster, cluster_of, initial_state, new_gpt  # noqa: F401

from paramshard.client import ClusterSpec, ShardClient, tools
from paramshard.models.gpt import Block, lm_loss
from paramshard.strategies import FSDPModel, FSDPOptimizer, ShardingConfiguration
from paramshard.strategies import train_with_recovery as train

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 10


def ranks(addresses, job, body) -> list:
    """``body(r, model, optimizer)`` on each of W ranks (threads); their results."""
    init, run = initial_state(), uuid.uuid4().hex[:6]

    def rank(r: int):
        client = ShardClient(
            ClusterSpec(addresses), rank=r, world_size=W, run_id=run, timeout_s=15, retries=3
        )
        try:
            config = ShardingConfiguration(client, job=job)
            net = new_gpt(init)
            model = FSDPModel(net, config, wrap=(Block,))
            opt = FSDPOptimizer(torch.optim.AdamW(net.parameters(), lr=3e-3), config)
            return body(r, model, opt)
        finally:
            client.close()

    with ThreadPoolExecutor(W) as pool:
        return [f.result(timeout=300) for f in [pool.submit(rank, r) for r in range(W)]]


def step_fn(model, opt, data, r: int, on_step=None):
    def step(s: int) -> float:
        if on_step is not None and r == 0:
            on_step(s)
        part = data[s, r * 2 : (r + 1) * 2]
        loss = lm_loss(model(part[:, :-1]), part[:, 1:])
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def single_process(a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """A's steps 0-4, then B's steps 5-9: the history run 2 ends on."""
    net = new_gpt(initial_state())
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    for s in range(STEPS):
        batch = (a if s < 5 else b)[s]
        lm_loss(net(batch[:, :-1]), batch[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return net.state_dict()


@pytest.mark.equivalence
@pytest.mark.parametrize(("kill_at", "resumed"), [(8, 8), (5, 5)], ids=["after-b8", "before-b"])
def test_a_recovery_after_a_rollback_stays_on_its_history(
    cluster,  # noqa: F811 - the fixture imported above
    kill_at,
    resumed,
) -> None:
    addresses, job = [s.address for s in cluster], f"rollback-{uuid.uuid4().hex[:6]}"
    a = torch.randint(0, 50, (STEPS, 2 * W, 17), generator=torch.Generator().manual_seed(2))
    b = torch.randint(0, 50, (STEPS, 2 * W, 17), generator=torch.Generator().manual_seed(7))

    def history_a(r, model, opt):
        train(model, step_fn(model, opt, a, r), STEPS, checkpoint_every=5, tag_prefix="a")

    ranks(addresses, job, history_a)
    kill, killed, restarted = killer(cluster[1], kill_at)

    def history_b(r, model, opt):
        model.load_checkpoint("a-5")  # the rollback: A past step 5 is given up
        report = train(
            model, step_fn(model, opt, b, r, kill), STEPS, checkpoint_every=2, tag_prefix="b",
            wait_s=60,
        )  # fmt: skip
        return report, model.state_dict()

    results = ranks(addresses, job, history_b)
    assert killed.is_set() and restarted, "the server was not killed and restarted"
    client = ShardClient(ClusterSpec(addresses))
    try:
        taken = [r["tag"] for r in tools.list_snapshots(client, job)]
    finally:
        client.close()
    assert taken[:3] == ["a-0", "a-5", "a-10"] and any(t.startswith("b-8") for t in taken), taken
    want = single_process(a, b)
    for report, state in results:
        assert report.failed_at == [kill_at] and report.resumed_at == [resumed], report
        assert sorted(report.losses) == list(range(5, STEPS)), report
        assert_equivalent(state, want, "history B after its recovery vs one process")


def test_the_snapshot_taken_last_is_latest(cluster) -> None:  # noqa: F811 - imported fixture
    """ "latest" is the snapshot taken last, here of a lower version than one taken before it
    (a rollback in between): in the listing's order and in ``restore``."""
    addresses, job = [s.address for s in cluster], f"order-{uuid.uuid4().hex[:6]}"
    a = torch.randint(0, 50, (STEPS, 2 * W, 17), generator=torch.Generator().manual_seed(3))

    def body(r, model, opt):
        step = step_fn(model, opt, a, r)
        for s in range(4):
            step(s)
            if s == 1:
                model.save_checkpoint("low")  # version 2
        model.save_checkpoint("high")  # version 4
        model.load_checkpoint("low")  # the rollback
        model.save_checkpoint("again")  # version 2, taken last
        return model.step_count

    assert ranks(addresses, job, body) == [2] * W
    client = ShardClient(ClusterSpec(addresses))
    try:
        listed = [(r["tag"], r["version"]) for r in tools.list_snapshots(client, job)]
        restored = tools.restore(client, job, "latest")
    finally:
        client.close()
    assert listed == [("low", 2), ("high", 4), ("again", 2)], listed
    assert restored == 2


def test_a_resumed_or_rolled_back_job_checkpoints_under_fresh_tags(cluster) -> None:  # noqa: F811
    """A job trained again on its servers (resumed at step 10, where it took auto-10) and then
    rolled back to auto-5: ``train_with_recovery``'s checkpoints at steps it took snapshots at
    before go under ``.1``, ``.2``. Before, the first one failed with ALREADY_EXISTS on rank
    0, and rank 1 spent its recoveries on a server it took for lost (review round 12)."""
    addresses, job = [s.address for s in cluster], f"resume-{uuid.uuid4().hex[:6]}"
    a = torch.randint(0, 50, (20, 2 * W, 17), generator=torch.Generator().manual_seed(4))

    def first(r, model, opt):
        return train(model, step_fn(model, opt, a, r), 10, checkpoint_every=5).recoveries

    def resumed(r, model, opt):
        report = train(model, step_fn(model, opt, a, r), 15, checkpoint_every=5)
        return report.recoveries, sorted(report.losses)

    def rolled_back(r, model, opt):
        model.load_checkpoint("auto-5")
        report = train(model, step_fn(model, opt, a, r), 10, checkpoint_every=5)
        return report.recoveries, sorted(report.losses)

    assert ranks(addresses, job, first) == [0] * W
    assert ranks(addresses, job, resumed) == [(0, list(range(10, 15)))] * W
    assert ranks(addresses, job, rolled_back) == [(0, list(range(5, 10)))] * W
    client = ShardClient(ClusterSpec(addresses))
    try:
        taken = [(r["tag"], r["version"]) for r in tools.list_snapshots(client, job)]
    finally:
        client.close()
    assert taken == [
        ("auto-0", 0), ("auto-5", 5), ("auto-10", 10),  # the first run
        ("auto-10.1", 10), ("auto-15", 15),  # resumed at 10
        ("auto-5.1", 5), ("auto-10.2", 10),  # rolled back to 5
    ], taken  # fmt: skip
