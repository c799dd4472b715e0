"""Which run a job's collectives are in when nothing names one (client/run_id.py).

Two jobs on the same servers whose environment named no run (no PARAMSHARD_RUN, torchrun's
static ``--rdzv-id`` default) both used to be in run "run": their all-reduces met in the same
slots, and the ranks that came first went on with sums mixing both jobs' values while the
others failed on slots already freed. A strategy's configuration now takes its job's run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import worker_env

from paramshard.client.run_id import job_run_id
from paramshard.strategies import ShardingConfiguration

_RANK = textwrap.dedent(
    """
    import os
    import numpy as np
    from paramshard.strategies import ShardingConfiguration

    config = ShardingConfiguration.from_env(job=os.environ["JOB"])
    c = config.client
    scale = 100.0 if os.environ["JOB"] == "b" else 1.0
    sums = {float(c.all_reduce(np.full(4, scale * (c.rank + 1), np.float32))[0]) for _ in range(20)}
    print(c.run_id, *sorted(sums), flush=True)
    c.close()
    """
)


def _unnamed(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PARAMSHARD_RUN", "TORCHELASTIC_RUN_ID", "PARAMSHARD_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def test_a_configuration_from_the_environment_takes_its_jobs_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _unnamed(monkeypatch)
    monkeypatch.setenv("PARAMSHARD_SERVERS", "127.0.0.1:1")  # a single rank: no RPC is made
    config = ShardingConfiguration.from_env(job="team-a")
    assert config.client.run_id == job_run_id("team-a") == "team-a"  # a job scope covers it
    config.client.close()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's static default names none
    config = ShardingConfiguration.from_env(job="team-a.e5")  # not read as a restart's epoch
    assert config.client.run_id == "team-a.e5-run"
    config.client.close()
    monkeypatch.setenv("PARAMSHARD_RUN", "named")  # a named run wins
    config = ShardingConfiguration.from_env(job="team-a")
    assert config.client.run_id == "named"
    config.client.close()


def test_two_jobs_without_a_run_id_keep_their_sums_apart(
    servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs of two ranks each on the same two servers at once, no run named: every
    all-reduce of each job is its own ranks' sum (job a: 1 + 2, job b: 100 + 200)."""
    _unnamed(monkeypatch)
    nodes = servers(2)
    env = {**worker_env(), "PARAMSHARD_SERVERS": ",".join(n.address for n in nodes)}
    env = {**env, "WORLD_SIZE": "2", "GRPC_VERBOSITY": "ERROR"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK],
            env={**env, "JOB": job, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for job in ("a", "b")
        for rank in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(ranks, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    got = [out.split() for out, _ in outs]
    assert got == [["a", "3.0"]] * 2 + [["b", "300.0"]] * 2, got
