"""A fixed-world rank restarted alone (its servers kept the job) in ``train_with_recovery``.

The others made collectives numbered in order (snapshot barriers, a loss's all-reduce) that
the new process did not, and a server forgets a collective once every rank has read it. The
restarted rank therefore starts with a recovery of every rank in a new epoch, whose
collectives start afresh ("rank 1 recovers: it was restarted at step N"), and nothing is
restored when every server holds the job at one version. Before, its first snapshot's barrier
named one the others had finished at step 0: NOT_FOUND "freed", raised outside the recovery,
and the rank's process failed (its restart spent, the job stopped); inside the loop, every
rank recovered once more, blaming a server (a field run).

- Under ``paramshard launch --max-restarts 1``: rank 1's trainer SIGKILLed at step 6,
  snapshots every 3 steps (float64 FSDP as tests/test_launch_node_down.py): exit 0, the
  final parameters equal to single-process training (1e-9), no restore.
- Servers at two versions (a step half applied as the rank died): the meeting restores them,
  from the neighbour replicas (in-process ranks).
- A loop of its own (no ``train_with_recovery``): the restarted rank's first barrier says it
  is behind the other ranks' collectives, not only that a slot was freed (in-process ranks).

Every wait is bounded.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_elastic import data
from test_elastic_rebuild import one_step
from test_job_lost import JOB, both_trained, in_threads
from test_launch_node_down import attach, killed_at_step_6, pids_of_ranks, rank_1_again
from test_launch_server_restarts import KILL_AT

from paramshard.client import ShardClient, ShardClientError
from paramshard.client.restarts import RESTART_COUNT_ENV
from paramshard.protos import shard_pb2 as pb
from paramshard.strategies import FSDPModel, FSDPOptimizer, train_with_recovery

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


@pytest.mark.equivalence
@pytest.mark.slow
def test_a_rank_restarted_alone_meets_the_others_in_a_new_epoch(tmp_path: Path) -> None:
    said = killed_at_step_6(
        tmp_path, "snapshots", ("--max-restarts", "1"), lambda out: [pids_of_ranks(out)[1]]
    )
    assert re.search(r"rank 1 failed with exit code -?\d+; restarting it", said), said
    assert "exited (exit code" not in said, said  # no server died
    # Rank 0 waits at step 6 while rank 1 is in it: killed after it sent all of step 6's
    # gradients, rank 1 comes back to servers rank 0's step 6 took to step 7 (a CI run);
    # killed before, to step 6. Either way, every line names the one step the servers hold.
    came = re.search(r"^\[rank 1\] rank 1: restarted at step (\d+), behind", said, re.M)
    assert came and int(came[1]) in (KILL_AT, KILL_AT + 1), said
    at = came[1]
    assert re.search(
        rf"^\[rank 0\] .*rank 1 recovers: it was restarted at step {at}; every rank meets it in"
        r" a new epoch$",
        said,
        re.M,
    ), said
    assert re.search(
        rf"^\[rank 0\] rank 0: step {at}: recovering with the others, meeting a restarted rank",
        said,
        re.M,
    ), said
    assert re.search(rf"every server holds it at step {at}: nothing to restore", said), said
    assert not re.search(r"server \d \(\S+\) lost", said), said  # no server blamed
    assert re.search(r"^\[rank 1\] recoveries 1 replayed 0$", said, re.M), said


def test_a_restarted_ranks_own_collective_says_it_is_behind(servers, monkeypatch) -> None:
    """Its loop makes a collective the others finished before it came: the error says why,
    where it said only that the slot "was read by all its readers and freed"."""
    addresses = [s.address for s in servers(2)]
    (c0, m0, _), (c1, _, _) = both_trained(addresses, "behind", elastic=False)
    met = in_threads({0: c0.barrier, 1: c1.barrier})  # barrier 1 of epoch 0, then freed
    assert [got for got, _ in met.values()] == [None, None], met
    c1.close()  # rank 1's process died; its server did not
    monkeypatch.setenv(RESTART_COUNT_ENV, "1")
    try:
        with rank_1_again(addresses, "behind", timeout_s=10) as (client, model):
            attach(model)
            assert model.restarted_alone and model.step_count == m0.step_count
            with pytest.raises(ShardClientError) as caught:
                client.barrier()  # the first barrier of epoch 0: both ranks made it before
            assert caught.value.code.name == "NOT_FOUND", caught.value
            assert "freed; this process is behind the other ranks' collectives" in str(
                caught.value
            ), caught.value
    finally:
        c0.close()


def steps_of(model: FSDPModel, opt: FSDPOptimizer) -> Callable[[int], float]:
    """``train_step``: this rank's part of the step's global batch (a function of the step)."""
    x, y = data(seed=2)
    return lambda step: one_step(model, opt, x[step % len(x)], y[step % len(x)])


def both_recovering(ranks: tuple, steps: int) -> dict:
    """``train_with_recovery`` to ``steps`` on both ranks ((model, optimizer) each) at once,
    no snapshots: ``in_threads``' results."""
    runs = {
        r: (lambda m=m, o=o: train_with_recovery(m, steps_of(m, o), steps, checkpoint_every=0,
                                                 wait_s=30))
        for r, (m, o) in enumerate(ranks)
    }  # fmt: skip
    return in_threads(runs)


def test_servers_a_step_apart_are_restored_at_the_meeting(servers, monkeypatch, caplog) -> None:
    """Server 1 one version behind server 0 (a step half applied as rank 1 died): rank 0
    restores the job from the neighbour replicas, where "every server holds it" would have
    trained on from two versions. Both ranks then train 2 more steps."""
    addresses = [s.address for s in servers(2)]
    (c0, m0, o0), (c1, _, _) = both_trained(addresses, "split", elastic=False)
    at = m0.step_count
    c1.close()  # rank 1's process died
    c0.call(1, "RollbackToReplica", pb.RollbackRequest(job=JOB, version=at - 1))
    monkeypatch.setenv(RESTART_COUNT_ENV, "1")
    caplog.set_level(logging.WARNING, logger="paramshard.recovery")
    try:
        with rank_1_again(addresses, "split", timeout_s=30) as (_, m1):
            o1 = attach(m1)
            assert m1.restarted_alone and m1.step_count == at - 1  # the older of the two
            got = both_recovering(((m0, o0), (m1, o1)), at + 2)
            reports = [got[r][0] for r in (0, 1)]
            assert all(not isinstance(r, Exception) for r in reports), got
            assert [r.recoveries for r in reports] == [1, 1], got
            assert reports[1].causes == ["RESTARTED"] and reports[0].causes == ["ABORTED"]
            assert m0.step_count == m1.step_count == at + 2
    finally:
        c0.close()
    assert "nothing to restore" not in caplog.text, caplog.text
    assert "recovered in" in caplog.text, caplog.text


def test_a_restarted_rank_is_asked_should_stop_with_the_others(servers, monkeypatch) -> None:
    """After the meeting, ``should_stop`` (a validation: an all-reduce every rank must make) is
    asked on both ranks about the step the servers hold, the restarted one with a NaN loss:
    rank 1 may have died in that validation, which rank 0 was then waiting in. Before, neither
    asked (the step was trained before the meeting), so a validation cut short was skipped."""
    addresses = [s.address for s in servers(2)]
    (c0, m0, o0), (c1, _, _) = both_trained(addresses, "asked", elastic=False)
    at = m0.step_count
    c1.close()  # rank 1's process died after step at - 1
    monkeypatch.setenv(RESTART_COUNT_ENV, "1")
    asked: dict[int, list[tuple[int, bool, float]]] = {0: [], 1: []}

    def validation(rank: int, client: ShardClient) -> Callable[[int, float], bool]:
        def should_stop(step: int, loss: float) -> bool:
            mean = float(client.all_reduce(torch.tensor([float(rank)]), "mean")[0])
            asked[rank].append((step, math.isnan(loss), mean))
            return False

        return should_stop

    try:
        with rank_1_again(addresses, "asked", timeout_s=30) as (c1, m1):
            o1 = attach(m1)
            assert m1.restarted_alone and m1.step_count == at
            runs = {
                r: (lambda m=m, o=o, c=c, r=r: train_with_recovery(
                    m, steps_of(m, o), at + 1, checkpoint_every=0, wait_s=30,
                    should_stop=validation(r, c)))
                for r, (m, o, c) in enumerate(((m0, o0, c0), (m1, o1, c1)))
            }  # fmt: skip
            got = in_threads(runs)
            assert all(not isinstance(got[r][0], Exception) for r in (0, 1)), got
            assert m0.step_count == m1.step_count == at + 1
    finally:
        c0.close()
    # step at - 1: asked after the meeting, no loss on either rank (neither trained it in
    # this call); step at: trained by both, with its loss; every validation on both ranks
    assert asked == {r: [(at - 1, True, 0.5), (at, False, 0.5)] for r in (0, 1)}, asked


def test_a_restarted_rank_whose_meeting_fails_still_comes_restarted_to_the_next(
    servers, monkeypatch, caplog
) -> None:
    """A failure cuts the restarted rank's first meeting short (here it gives up that epoch
    itself, as it would on losing a server): it recovers again, and at that meeting it still
    says it came restarted, so rank 0 finds every server at one step and restores nothing.
    Before, the second meeting had no restarted rank: rank 0 restored the job, as after a
    server's loss, from the replicas here, from a snapshot or not at all (JobLost) elsewhere."""
    addresses = [s.address for s in servers(2)]
    (c0, m0, o0), (c1, _, _) = both_trained(addresses, "again", elastic=False)
    at = m0.step_count
    c1.close()  # rank 1's process died after step at - 1
    monkeypatch.setenv(RESTART_COUNT_ENV, "1")
    caplog.set_level(logging.WARNING, logger="paramshard")
    said: list[bool] = []  # what rank 1's meetings said: came restarted
    try:
        with rank_1_again(addresses, "again", timeout_s=30) as (c1, m1):
            o1 = attach(m1)
            meet = m1.recover

            def cut_short_once(restarted: bool = False) -> int:
                said.append(restarted)
                if len(said) == 1:  # the meeting's epoch ends before it is met
                    c1.run_state.give_up("recovers: a failure in the test")
                return meet(restarted=restarted)

            monkeypatch.setattr(m1, "recover", cut_short_once)
            got = both_recovering(((m0, o0), (m1, o1)), at + 1)
            assert all(not isinstance(got[r][0], Exception) for r in (0, 1)), got
            assert m0.step_count == m1.step_count == at + 1
            assert got[1][0].causes == ["RESTARTED", "ABORTED"], got
    finally:
        c0.close()
    assert said == [True, True], said
    assert f"every server holds it at step {at}: nothing to restore" in caplog.text, caplog.text
