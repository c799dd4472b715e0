"""A ZeRO or FSDP job that is already on the servers resumes there (docs/training.md): rank 0
says so once, so a script run again under the same job name against running servers does not
resume in silence (seen in a check from outside: a job run again under a fixed ``--run-id``).
A rank that is restarted (``PARAMSHARD_RESTART_COUNT``) resumes by design and says nothing.

One real in-process server, one rank (a client of world size 1), a real torch model.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from conftest import unique_id

from paramshard.client import ClusterSpec, ShardClient
from paramshard.strategies import (
    FSDPModel,
    FSDPOptimizer,
    ShardingConfiguration,
    ZeRO1Model,
    ZeRO1Optimizer,
)

NOTICE = "is on the servers at step"
KINDS = {"fsdp": (FSDPModel, FSDPOptimizer), "zero1": (ZeRO1Model, ZeRO1Optimizer)}


@pytest.fixture
def address(servers: Any) -> str:
    return servers(1)[0].address


def build(address: str, job: str, kind: str = "fsdp") -> tuple[ShardClient, Any, Any]:
    """A client, a model and its optimizer (which registers the job on the servers)."""
    client = ShardClient(ClusterSpec([address]))
    torch.manual_seed(0)
    model_type, opt_type = KINDS[kind]
    model = model_type(torch.nn.Linear(4, 2), ShardingConfiguration(client, job=job))
    return client, model, opt_type(torch.optim.SGD(model.parameters(), lr=0.1), model.config)


def test_a_job_on_the_servers_says_it_resumes(
    address: str, caplog: pytest.LogCaptureFixture
) -> None:
    job = unique_id("again")
    client, model, opt = build(address, job)
    try:
        for _ in range(2):
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        client.close()
    assert not [r for r in caplog.records if NOTICE in r.getMessage()], caplog.text
    for kind in KINDS:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            client, model, _ = build(address, job, kind)
            client.close()
        assert model.step_count == 2
        said = [r.getMessage() for r in caplog.records if NOTICE in r.getMessage()]
        assert said == [
            f"job '{job}' is on the servers at step 2: it resumes there (model.step_count);"
            " a new job name starts afresh"
        ], caplog.text


def test_a_restarted_rank_resumes_without_a_word(
    address: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = unique_id("restarted")
    client, model, opt = build(address, job)
    try:
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
    finally:
        client.close()
    monkeypatch.setenv("PARAMSHARD_RESTART_COUNT", "1")
    with caplog.at_level(logging.WARNING):
        client, model, _ = build(address, job)
        client.close()
    assert model.step_count == 1
    assert NOTICE not in caplog.text, caplog.text


ANEW = "holding no values on any server"


def test_a_restarted_rank_that_finds_its_job_on_no_server_says_it_starts_anew(
    address: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its servers were restarted empty since it last ran (a field review: both servers lost,
    no snapshot, the ranks restarted): it starts the job at step 0 again, and says so. A first
    process starting a new job says nothing. Before, the restarted rank started in silence."""
    job = unique_id("anew")
    with caplog.at_level(logging.WARNING):
        client, model, _ = build(address, job)
        client.close()
    assert model.step_count == 0 and ANEW not in caplog.text, caplog.text
    job = unique_id("anew")
    monkeypatch.setenv("PARAMSHARD_RESTART_COUNT", "2")
    with caplog.at_level(logging.WARNING):
        client, model, _ = build(address, job)
        client.close()
    assert model.step_count == 0
    said = [r.getMessage() for r in caplog.records if ANEW in r.getMessage()]
    assert said == [
        f"rank 0 was restarted (PARAMSHARD_RESTART_COUNT=2) and finds job '{job}' holding no"
        " values on any server (they were restarted empty since it last ran, or the job never"
        " trained a step): the job starts at step 0; model.load_checkpoint('latest') restores"
        " its newest snapshot, if any"
    ], caplog.text
