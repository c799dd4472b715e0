"""The ranks' work at the end of training (``train_with_recovery(finish=)``, and the validation
``should_stop`` makes after a step) survives a shard server dying: SIGKILL one server process
inside ``finish`` or ``should_stop``, restart it at the same address, and every rank recovers,
runs the hook again and finds the model (and the validation) an uninterrupted run ends with.

The servers, ranks and model are test_recovery.py's: real ``paramshard serve`` processes with a
shared snapshot directory, two rank threads, a float64 GPT (within 1e-9, tests/numerics.py).
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict

import pytest
import torch
from numerics import assert_equivalent
from server_processes import killer
from test_recovery import (  # noqa: F401 - cluster_of is a fixture
    EVERY,
    STEPS,
    W,
    cluster_of,
    initial_state,
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
    should_stop = None if stop_at is None else (lambda s, *_: s == stop_at)
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


@pytest.mark.equivalence
def test_a_server_killed_in_should_stop_is_recovered_and_it_decides_again(
    cluster_of,  # noqa: F811 - the fixture imported above
):
    """Server 1 dies while the ranks validate after the last step (``should_stop``'s two
    all-reduces, one of which meets server 1): every rank recovers from the neighbour replicas
    at the last step, nothing replayed, and ``should_stop`` is asked again for that step, so the
    validation the failure cut short is made, with the values of an uninterrupted run. Before,
    the recovery found every step trained and training ended unvalidated."""
    last = STEPS - 1
    init = initial_state()
    data = torch.randint(0, 50, (STEPS, 2 * W, 17), generator=torch.Generator().manual_seed(6))
    cluster = cluster_of(W)
    addresses = [s.address for s in cluster]
    kill_server_1, killed, restarted_after = killer(cluster[1], last)

    def validation(asked: defaultdict[int, list], kill: bool):
        """A ``should_stop`` that validates after the last step (the loss's mean and sum over
        the ranks) into ``asked[rank]``: None for an ask cut short. Never stops."""
        arrived, after_kill = threading.Barrier(W), threading.Barrier(W)

        def should_stop(step, loss, rank, client, job) -> bool:
            if step != last:
                return False
            asked[rank].append(None)
            if kill and len(asked[rank]) == 1:
                arrived.wait(timeout=60)  # every rank is through the step
                if rank == 0:
                    wait_for_replica(client, job, 1, STEPS)  # the recovery replays nothing
                    kill_server_1(last)
                after_kill.wait(timeout=60)
            value = torch.tensor([loss], dtype=torch.float64)
            mean = float(client.all_reduce(value, "mean")[0])
            asked[rank][-1] = (mean, float(client.all_reduce(value, "sum")[0]))
            return False

        return should_stop

    expected: defaultdict[int, list] = defaultdict(list)
    reference = train(addresses, init, data, should_stop=validation(expected, kill=False))
    asked: defaultdict[int, list] = defaultdict(list)
    recovered = train(
        addresses, init, data, replicate_every=1, should_stop=validation(asked, kill=True)
    )
    assert killed.is_set() and restarted_after, "the server was not killed and restarted"
    pairs = zip(recovered, reference, strict=True)
    for rank, ((state, report), (ref_state, _)) in enumerate(pairs):
        assert report.recoveries == 1 and report.replayed_steps == 0, report
        assert report.trained_steps == list(range(STEPS)) and not report.stopped_early, report
        assert asked[rank][0] is None, asked  # cut short by the kill
        assert len(asked[rank]) == 2 and asked[rank][1] is not None, asked  # asked again
        assert asked[rank][1] == pytest.approx(expected[rank][0], rel=1e-9, abs=0), asked
        assert_equivalent(state, ref_state, "validated after a recovery vs uninterrupted")
