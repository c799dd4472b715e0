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
- A loop of its own (no ``train_with_recovery``): the restarted rank's first barrier says it
  is behind the other ranks' collectives, not only that a slot was freed (in-process ranks).

Every wait is bounded.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_job_lost import both_trained, in_threads
from test_launch_node_down import attach, killed_at_step_6, pids_of_ranks, rank_1_again

from paramshard.client import ShardClientError
from paramshard.client.restarts import RESTART_COUNT_ENV

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


@pytest.mark.equivalence
@pytest.mark.slow
def test_a_rank_restarted_alone_meets_the_others_in_a_new_epoch(tmp_path: Path) -> None:
    said = killed_at_step_6(
        tmp_path, "snapshots", ("--max-restarts", "1"), lambda out: [pids_of_ranks(out)[1]]
    )
    assert re.search(r"rank 1 failed with exit code -?\d+; restarting it", said), said
    assert "exited (exit code" not in said, said  # no server died
    assert re.search(
        r"^\[rank 0\] .*rank 1 recovers: it was restarted at step 6; every rank meets it in a"
        r" new epoch$",
        said,
        re.M,
    ), said
    assert re.search(r"every server holds it at step 6: nothing to restore", said), said
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
