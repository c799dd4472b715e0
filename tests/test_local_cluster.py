"""LocalCluster: N ranks and their servers in one process, as threads or spawned processes.

Training through it equals single-process float64 training within tests/numerics.py's bound
(the rank function is test_strategies' ``train_rank``, whose ``train_sharded`` also runs on
LocalCluster); a failing rank is named; ``processes=True`` runs picklable functions and refuses
others with a clear message; ``import paramshard`` stays free of grpc and torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from functools import partial

import numpy as np
import pytest
import torch
from conftest import run_ranks, worker_env
from test_strategies import assert_matches, batches, initial_state, train_rank, train_single

from paramshard import LocalCluster, RankFailed
from paramshard.local_processes import RemoteTraceback


@pytest.fixture(scope="module")
def float64_run():
    init, data = initial_state(), batches()
    return init, data, train_single("adamw", init, data)


# -- functions the spawned processes import by name (module level: picklable) ----------------
def sum_ranks(config) -> tuple[int, int, float]:
    total = config.client.all_reduce(np.array([config.rank + 1.0]))
    return config.rank, os.getpid(), float(total[0])


def fail_on_rank_one(config) -> int:
    if config.rank == 1:
        raise ValueError(f"boom in rank {config.rank}")
    return config.rank


def describe(config) -> tuple:
    return config.rank, config.world_size, config.job, config.deterministic, config.client.run_id


# -- the public API ------------------------------------------------------------------------
def test_import_paramshard_pulls_in_no_grpc_or_torch() -> None:
    code = (
        "import paramshard, sys; "
        "print('grpc' in sys.modules, 'torch' in sys.modules, 'numpy' in sys.modules); "
        "paramshard.LocalCluster; print('grpc' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split() == ["False", "False", "False", "False"], out.stdout


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_training_equals_single_process(float64_run, strategy, one_torch_thread) -> None:
    init, data, reference = float64_run
    with LocalCluster(world_size=2) as cluster:
        assert len(cluster.addresses) == 2
        results = cluster.run(partial(train_rank, strategy, "adamw", init, data))
    assert_matches(reference, results, f"LocalCluster {strategy}")


def test_processes_train_equal_single_process(float64_run) -> None:
    """DDP on two spawned processes (gRPC over 127.0.0.1 to the parent's servers)."""
    init, data, reference = float64_run
    with LocalCluster(world_size=2, processes=True, run_timeout_s=300) as cluster:
        results = cluster.run(partial(train_rank, "ddp", "adamw", init, data))
    assert_matches(reference, results, "LocalCluster processes ddp")


def test_processes_run_module_level_fn_in_rank_order() -> None:
    with LocalCluster(world_size=2, servers=1, processes=True, run_timeout_s=120) as cluster:
        results = cluster.run(sum_ranks)
    assert [r for r, _, _ in results] == [0, 1]
    assert len({pid for _, pid, _ in results} | {os.getpid()}) == 3
    assert all(total == 3.0 for _, _, total in results)


def test_processes_name_the_failing_rank() -> None:
    with LocalCluster(world_size=2, processes=True, run_timeout_s=120) as cluster:
        with pytest.raises(RankFailed, match="rank 1 of 2 failed: ValueError: boom") as info:
            cluster.run(fail_on_rank_one)
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, ValueError)
    remote = info.value.__cause__.__cause__
    assert isinstance(remote, RemoteTraceback) and "fail_on_rank_one" in remote.text


def test_processes_refuse_an_unpicklable_fn() -> None:
    def local_fn(config):
        return config.rank

    with LocalCluster(world_size=2, processes=True) as cluster:
        for fn in (local_fn, lambda config: config.rank):
            with pytest.raises(TypeError, match="must be picklable.*module level"):
                cluster.run(fn)


def test_threads_name_the_failing_rank_and_stop_the_others() -> None:
    def fn(config):
        if config.rank == 2:
            raise KeyError("no such layer")
        config.client.barrier()  # waits for rank 2, which never comes: ends when closed
        return config.rank

    # timeout_s: the others' barrier ends at this deadline (closing a client does not cancel
    # its in-process calls), well inside the 10 s they are given after rank 2 fails
    with LocalCluster(world_size=3, timeout_s=3) as cluster:
        with pytest.raises(RankFailed, match="rank 2 of 3 failed: KeyError") as info:
            cluster.run(fn)
        assert isinstance(info.value.__cause__, KeyError)
        assert cluster.run(describe)[2][0] == 2  # the cluster still works afterwards


def test_config_fields_apply_to_every_rank_and_each_run_is_fresh() -> None:
    with LocalCluster(world_size=2, deterministic=False) as cluster:
        first = cluster.run(describe)
        second = cluster.run(describe, job="named")
    assert [d[:2] for d in first] == [(0, 2), (1, 2)]
    assert all(d[3] is False for d in first + second)  # the cluster's field, every run
    run_ids = {d[4] for d in first}, {d[4] for d in second}
    assert len(run_ids[0]) == len(run_ids[1]) == 1 and run_ids[0] != run_ids[1]
    assert first[0][2] != second[0][2] == "named"  # a fresh job unless named


def test_existing_servers_by_address(shared_servers) -> None:
    with LocalCluster(world_size=3, servers=shared_servers[:2]) as cluster:
        assert cluster.addresses == shared_servers[:2]
        assert [r for r, _, _ in cluster.run(sum_ranks)] == [0, 1, 2]
    assert cluster.addresses == []


def test_bad_input_is_named() -> None:
    with pytest.raises(TypeError, match="'lr' is not a ShardingConfiguration field"):
        LocalCluster(world_size=2, lr=0.1)
    with pytest.raises(ValueError, match="ShardingConfiguration.param_dtype must be one of"):
        LocalCluster(world_size=2, param_dtype="fp8")
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        LocalCluster(world_size=0)
    with pytest.raises(ValueError, match="servers must be a number"):
        LocalCluster(world_size=2, servers="127.0.0.1:1")
    with pytest.raises(ValueError, match="server_options configure the servers the cluster"):
        LocalCluster(world_size=2, servers=["127.0.0.1:1"], server_options={"max_memory": 0})
    with pytest.raises(RuntimeError, match="needs running servers"):
        LocalCluster(world_size=1).run(describe)
    with LocalCluster(world_size=1) as cluster:
        with pytest.raises(ValueError, match="gradient_accumulation_steps"):
            cluster.run(describe, gradient_accumulation_steps=0)


def test_a_run_past_its_timeout_names_the_ranks_still_running() -> None:
    release = threading.Event()

    def fn(config):
        if config.rank == 1:
            release.wait(60)  # bounded; released below
        return config.rank

    with LocalCluster(world_size=2, run_timeout_s=0.5) as cluster:
        try:
            with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 still running"):
                cluster.run(fn)
        finally:
            release.set()


def test_run_ranks_reraises_the_ranks_own_exception() -> None:
    """The suite's helper shares LocalCluster's threads but keeps the original exception."""
    with LocalCluster(world_size=1) as cluster:

        def fn(client):
            if client.rank == 1:
                raise ZeroDivisionError("rank one divides")
            client.barrier()

        with pytest.raises(ZeroDivisionError, match="rank one divides") as info:
            run_ranks(fn, 2, cluster.addresses, timeout_s=3)
    assert "(raised by rank 1 of 2)" in getattr(info.value, "__notes__", [""])[-1]


def test_thread_ranks_share_torch_global_rng() -> None:
    """What the README warns about: a seed set in one thread rank is every rank's."""
    barrier = threading.Barrier(2, timeout=30)

    def fn(config):
        if config.rank == 0:
            torch.manual_seed(11)
        barrier.wait()
        draw = torch.rand(1).item() if config.rank == 1 else None
        barrier.wait()
        return draw

    with LocalCluster(world_size=2) as cluster:
        drawn = cluster.run(fn)[1]
    assert drawn == torch.rand(1, generator=torch.Generator().manual_seed(11)).item()
