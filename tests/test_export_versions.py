"""A live export is of one version or is not written (client/export.py ``one_version``).

Export writes the safetensors header, with the version Status reports, before it pulls the
first tensor; a step that lands between two pulls (training runs) used to give a file of
tensors at two versions under one. Here a trainer applies a step in the middle of an export
(from a hook around ``pull_param``, so where it lands is exact): the export must then either
write a file whose every tensor is of the version its metadata records, or raise an error that
says to pause or snapshot, leaving no file. A paused job exports as before.
"""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.torch import load_file
from snapshot_job import STEPS, client_for, one_rank, train_steps

from paramshard.client import export_hf as export_hf_module
from paramshard.client import jobs, tools
from paramshard.server import ShardServer

TRAINED = 2  # steps before the export; the rest (STEPS - TRAINED) are taken during it


@pytest.fixture
def job() -> Any:
    """A ZeRO-1 job trained TRAINED steps by one rank on two servers, its trainer kept to
    step on, and a client of the tools."""
    started = [ShardServer("127.0.0.1", 0).start() for _ in range(2)]
    addresses = [s.address for s in started]
    name, trainer, model, opt, data = one_rank(addresses, TRAINED)
    taken = itertools.count(TRAINED)

    def step() -> bool:
        """One more step, while there are batches for one."""
        s = next(taken)
        if s < STEPS:
            train_steps(model, opt, 0, 1, data, [s])
        return s < STEPS

    client = client_for(addresses)
    yield SimpleNamespace(name=name, client=client, step=step)
    client.close()
    trainer.close()
    for s in started:
        s.stop(0)


def step_after_pulls(monkeypatch: Any, step: Any, which: Any) -> list[int]:
    """Applies ``step()`` right after every pull whose number (1, 2, ...) ``which`` accepts;
    returns the numbers of the pulls after which a step was applied."""
    real, count, stepped = jobs.pull_param, itertools.count(1), []

    def pull(*args: Any, **kwargs: Any) -> np.ndarray:
        out = real(*args, **kwargs)
        n = next(count)
        if which(n) and step():
            stepped.append(n)
        return out

    monkeypatch.setattr(jobs, "pull_param", pull)
    return stepped


def hf_config(monkeypatch: Any) -> None:
    """The tiny GPT is no Hugging Face model: a recorded config stands in for it."""
    described = {"architecture": "GPT2LMHeadModel", "config": {"tie_word_embeddings": True}}
    monkeypatch.setattr(export_hf_module, "live_model_config", lambda c, j: described)


def export(kind: str, client: Any, name: str, tmp_path: Path) -> tuple[int, Path]:
    if kind == "hf":
        count = export_hf_module.export_hf(client, name, tmp_path / "hf")
        return count, tmp_path / "hf" / "model.safetensors"
    return tools.export(client, name, tmp_path / "m.safetensors"), tmp_path / "m.safetensors"


def assert_one_version(client: Any, name: str, path: Path) -> int:
    """Every tensor of ``path`` is what the servers hold now (training paused), at the
    version its metadata records; returns that version."""
    with safe_open(str(path), framework="pt") as f:
        version = int(f.metadata()["version"])
    assert {b.version for b in jobs.server_jobs(client).status[name].buffers} == {version}
    loaded = load_file(str(path))
    assert loaded
    for p in tools.job_params(client, name):
        want = tools.get_param(client, name, p.name)
        for each in (p.name, *p.aliases):
            if each in loaded:
                assert np.array_equal(loaded[each].numpy(), want), f"{each}: another version"
    return version


@pytest.mark.parametrize("kind", ["out", "hf"])
def test_a_step_during_the_export_is_retried_to_one_version(job, tmp_path, monkeypatch, kind):
    if kind == "hf":
        hf_config(monkeypatch)
    stepped = step_after_pulls(monkeypatch, job.step, lambda n: n == 2)
    count, path = export(kind, job.client, job.name, tmp_path)
    assert stepped == [2]  # a step did land between the 2nd and 3rd pull of the first attempt
    assert count == len(load_file(str(path)))
    monkeypatch.undo()
    assert assert_one_version(job.client, job.name, path) == TRAINED + 1


@pytest.mark.parametrize("kind", ["out", "hf"])
def test_steps_during_every_attempt_refuse_the_export(job, tmp_path, monkeypatch, kind):
    if kind == "hf":
        hf_config(monkeypatch)
    # a step after every 3rd pull: every attempt (more than 3 pulls) sees one land mid-way
    stepped = step_after_pulls(monkeypatch, job.step, lambda n: n % 3 == 0)
    with pytest.raises(RuntimeError, match="changed version while it was exported") as err:
        export(kind, job.client, job.name, tmp_path)
    message = str(err.value)
    assert "Pause training" in message and f"paramshard snapshot {job.name}" in message
    assert "paramshard export --snapshot" in message and "Nothing was written" in message
    assert len(stepped) == 3 <= STEPS - TRAINED  # one per attempt, each one its own
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # no file, no temporary file


@pytest.mark.parametrize("kind", ["out", "hf"])
def test_a_paused_job_exports_as_before(job, tmp_path, monkeypatch, kind):
    if kind == "hf":
        hf_config(monkeypatch)
    count, path = export(kind, job.client, job.name, tmp_path)
    assert count == len(load_file(str(path)))
    assert assert_one_version(job.client, job.name, path) == TRAINED
    if kind == "out":
        assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]
    else:
        assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
            "config.json",
            "model.safetensors",
        ]


@pytest.mark.usefixtures("one_torch_thread")
def test_the_parts_of_a_3d_job_are_of_one_version_too(tmp_path, monkeypatch):
    """A 3D job's base name exports its parts (``jobs != [job]``) through the same check. Its
    ranks cannot be stepped from a hook; a pull reporting the next version stands in for a
    step landing between two pulls."""
    from hybrid_runs import client_for as hybrid_client
    from hybrid_runs import run_hybrid

    started = [ShardServer("127.0.0.1", 0).start() for _ in range(2)]
    addresses = [s.address for s in started]
    name = f"gpt3d-{uuid.uuid4().hex[:6]}"
    client = hybrid_client(addresses)
    try:
        run_hybrid(1, 2, 1, addresses, name, lambda model, opt, train: train(0))
        real, count, moved = jobs.pull_param, itertools.count(1), set()

        def pull(*args: Any) -> np.ndarray:
            out = real(*args)
            versions = args[3] if len(args) > 3 else None  # the pulls' versions, if kept
            if next(count) in moved and versions:
                versions.append(versions[-1] + 1)  # as if a step landed under this pull
            return out

        monkeypatch.setattr(jobs, "pull_param", pull)
        moved.update(range(1, 1000))
        out = tmp_path / "m.safetensors"
        with pytest.raises(RuntimeError, match="changed version while it was exported"):
            tools.export(client, name, out)
        assert not list(tmp_path.iterdir())
        moved.clear()
        moved.add(next(count) + 1)  # once: the next attempt's first pull
        assert tools.export(client, name, out) == len(load_file(str(out)))
        with safe_open(str(out), framework="pt") as f:
            meta = f.metadata()
        assert meta["version"] == "1" and meta["parts"] == f"{name}.pp0.tp0,{name}.pp0.tp1"
    finally:
        client.close()
        for s in started:
            s.stop(0)
