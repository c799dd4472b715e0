"""The ranks' work at the end of training (``train_with_recovery(finish=)``) survives a shard
server dying: SIGKILL one server process inside ``finish``, restart it at the same address, and
every rank recovers, runs ``finish`` again and finds the model an uninterrupted run ends with.

The servers, ranks and model are test_recovery.py's: real ``paramshard serve`` processes with a
shared snapshot directory, two rank threads, a float64 GPT (within 1e-9, tests/numerics.py).
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from numerics import assert_equivalent
from test_recovery import (  # noqa: F401 - cluster_of is a fixture
    EVERY,
    STEPS,
    W,
    cluster_of,
    initial_state,
    killer,
    train,
    wait_for_replica,
)

from paramshard.client import ShardClient

pytestmark = [pytest.mark.faults, pytest.mark.slow]


@pytest.mark.equivalence
@pytest.mark.parametrize("replicate_every", [1, 0], ids=["replica", "snapshot-stopped-early"])
def test_a_server_killed_in_finish_is_recovered_and_finish_runs_again(
    cluster_of,  # noqa: F811 - the fixture imported above
    replicate_every,
):
    """Server 1 dies once training has ended, while the ranks gather the model in
    ``finish``: every rank recovers and runs ``finish`` again, and gathers the parameters of
    an uninterrupted run. With replicas the servers come back at the last step, nothing is
    replayed. With snapshots every EVERY steps and ``should_stop`` ending training after
    step STEPS - 3, they come back at the last snapshot before it: the steps from there are
    replayed, ``should_stop`` ends training at the same step again, then ``finish`` runs."""
    stop_at = None if replicate_every else STEPS - 3  # not a multiple of EVERY: replayed
    should_stop = None if stop_at is None else (lambda s: s == stop_at)
    end = STEPS if stop_at is None else stop_at + 1
    init = initial_state()
    data = torch.randint(0, 50, (STEPS, 2 * W, 17), generator=torch.Generator().manual_seed(5))
    cluster = cluster_of(W)
    addresses = [s.address for s in cluster]
    reference = train(addresses, init, data, should_stop=should_stop)

    kill_server_1, killed, restarted_after = killer(cluster[1], end)
    calls: Counter[int] = Counter()
    all_in_finish = threading.Barrier(W)

    def at_end(rank: int, client: ShardClient, job: str) -> None:
        calls[rank] += 1
        if calls[rank] > 1:
            return
        all_in_finish.wait(timeout=60)  # no rank is still in its last step at the kill
        if rank == 0:
            if replicate_every:  # its neighbour holds the last step: nothing to replay
                wait_for_replica(client, job, 1, end)
            kill_server_1(end)

    recovered = train(
        addresses, init, data, replicate_every=replicate_every, at_end=at_end,
        should_stop=should_stop,
    )  # fmt: skip
    assert killed.is_set() and restarted_after, "the server was not killed and restarted"
    assert calls == {r: 2 for r in range(W)}, calls
    replayed = 0 if replicate_every else end - end // EVERY * EVERY
    for (state, report), (ref_state, _) in zip(recovered, reference, strict=True):
        assert report.recoveries == 1 and report.failed_at == [end], report
        assert report.replayed_steps == replayed, report
        assert report.trained_steps == list(range(end)), report
        assert report.stopped_early == (stop_at is not None), report
        assert_equivalent(state, ref_state, "gathered after a recovery in finish vs uninterrupted")
