"""A job being trained is not restored under its ranks: ``paramshard restore`` (a client of no
run of the job) is refused while the job's ranks hold leases on its servers, since the swap
made their next call fail (seen in a check from outside: the tool printed "restored", and the
training died a few seconds later on "buffer ... was dropped"). The run's own ranks restore it
(``train_with_recovery``'s recovery does), and so does anyone once the ranks are gone.

Two real in-process servers with a snapshot folder; two ranks as threads with their own
clients (conftest.run_ranks); ZeRO-1 on the snapshot tests' GPT.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import run_ranks
from snapshot_job import (
    batches,
    client_for,
    initial_weights,
    new_job,
    snapshot_servers,
    train_steps,
    versions_of,
    wrap,
)

from paramshard.client import ShardClient, ShardClientError, tools


def refused_restore(addresses: list[str], job: str) -> ShardClientError:
    """A tool's restore of ``job`` from snapshot "t1", which must be refused."""
    tool = client_for(addresses)
    try:
        with pytest.raises(ShardClientError) as info:
            tools.restore(tool, job, "t1")
        return info.value
    finally:
        tool.close()


def test_a_job_in_training_is_restored_by_its_own_ranks_only(servers: Any, tmp_path: Path) -> None:
    addresses = [s.address for s in snapshot_servers(servers, 2, tmp_path)]
    job, init, data = new_job("guard"), initial_weights(), batches()
    refused: list[ShardClientError] = []
    trained = threading.Barrier(2, timeout=60)

    def rank(client: ShardClient) -> int:
        model, opt = wrap("zero1", client, job, init)
        train_steps(model, opt, client.rank, 2, data, range(2))
        if client.rank == 0:
            tools.snapshot(client, job, "t1")
        train_steps(model, opt, client.rank, 2, data, range(2, 3))
        trained.wait()  # both ranks hold their leases, at step 3
        if client.rank == 0:
            refused.append(refused_restore(addresses, job))
            return tools.restore(client, job, "t1")  # the run's own rank: a recovery
        return 0

    restored, _ = run_ranks(rank, 2, addresses)
    assert restored == 2
    (err,) = refused
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION, err
    assert f"restore: job '{job}' is being trained: 2 rank(s) of run" in err.details, err
    assert versions_of(addresses, job) == {2}  # the rank's restore, not the refused one
    tool = client_for(addresses)  # the ranks closed their clients: anyone may restore
    try:
        assert tools.restore(tool, job, "t1") == 2
    finally:
        tool.close()


def test_a_group_of_one_in_a_larger_run_names_its_run(servers: Any, tmp_path: Path) -> None:
    """A rank of a 3D job may train through a data-parallel group of one (its own replica):
    the group has no peers of its own, but the rank's run does and holds leases, so its
    buffers name that run and the guard above holds for them too."""
    addresses = [s.address for s in snapshot_servers(servers, 2, tmp_path)]
    job, init, data = new_job("solo"), initial_weights(), batches()
    refused: list[ShardClientError] = []
    trained = threading.Barrier(2, timeout=60)

    def rank(client: ShardClient) -> None:
        if client.rank == 0:
            group = client.subgroup([0], "dp0")
            model, opt = wrap("zero1", group, job, init)
            train_steps(model, opt, 0, 1, data, range(2))
            tools.snapshot(group, job, "t1")
        trained.wait()  # rank 1 holds its lease beside: the run has two live ranks
        if client.rank == 0:  # rank 0's group works on its own server
            refused.append(refused_restore(addresses[:1], job))

    run_ranks(rank, 2, addresses)
    (err,) = refused
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION, err
    assert f"restore: job '{job}' is being trained" in err.details, err
