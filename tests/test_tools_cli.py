"""``paramshard inspect · get · snapshot · snapshots · restore · export`` run as users run them:
``python -m paramshard ...`` subprocesses against in-process servers holding a trained job
(float32: the float64 round trips are in test_snapshots.py and test_export.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_ranks, worker_env
from safetensors.torch import load_file
from snapshot_job import (
    CFG,
    batches,
    initial_weights,
    new_job,
    snapshot_servers,
    train_steps,
    wrap,
)

from paramshard.client import ClusterSpec, ShardClient, tools
from paramshard.models.gpt import GPT
from paramshard.server import ShardServer

STEPS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Any:
    """Two servers with a snapshot directory; job trained STEPS steps by two ranks (ZeRO-1)."""
    root = tmp_path_factory.mktemp("snaps")
    started: list[ShardServer] = []

    def factory(n: int, **kw: Any) -> list[ShardServer]:
        new = [ShardServer("127.0.0.1", 0, **kw).start() for _ in range(n)]
        started.extend(new)
        return new

    addresses = [s.address for s in snapshot_servers(factory, 2, root)]
    job, init, data = new_job("cli"), initial_weights(torch.float32), batches()

    def rank(client: ShardClient) -> dict:
        model, opt = wrap("zero1", client, job, init)
        train_steps(model, opt, client.rank, 2, data, range(STEPS))
        return model.state_dict()

    trained = run_ranks(rank, 2, addresses)[0]
    yield {"addresses": addresses, "job": job, "root": root, "trained": trained}
    for s in started:
        s.stop(0)


def cli(cluster: dict, *args: str, cwd: Any = None) -> subprocess.CompletedProcess:
    env = worker_env()
    env.pop("PARAMSHARD_SERVERS", None)
    cmd = [sys.executable, "-m", "paramshard", *args]
    if args[0] != "export" or "--snapshot" not in args:
        cmd += ["--servers", ",".join(cluster["addresses"])]
    return subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=60, env=env, cwd=cwd
    )


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout


def test_inspect_and_get(cluster, tmp_path):
    job, trained = cluster["job"], cluster["trained"]
    rows = json.loads(ok(cli(cluster, "inspect", job, "--json")))
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) | {"lm_head.weight"} == set(trained)
    assert by_name["wte.weight"]["aliases"] == ["lm_head.weight"]
    for name, r in by_name.items():
        values = trained[name].numpy()
        assert r["shape"] == list(values.shape) and r["dtype"] == "float32"
        assert r["version"] == STEPS and r["finite"] is True
        assert set(r["servers"]) <= {0, 1} and r["servers"]
        assert r["norm"] == pytest.approx(float(np.linalg.norm(values.astype(np.float64))))
        assert r["min"] == pytest.approx(float(values.min()))
        assert r["max"] == pytest.approx(float(values.max()))
    table = ok(cli(cluster, "inspect", job))
    assert "wte.weight" in table and "NORM" in table

    out = tmp_path / "x.npy"
    ok(cli(cluster, "get", job, "wte.weight", "--out", str(out)))
    np.testing.assert_array_equal(np.load(out), trained["wte.weight"].numpy())
    out = tmp_path / "x.safetensors"
    ok(cli(cluster, "get", job, "lm_head.weight", "--out", str(out)))  # by its tied name
    torch.testing.assert_close(
        load_file(str(out))["lm_head.weight"], trained["wte.weight"], rtol=0, atol=0
    )


def test_snapshot_list_restore_export(cluster, tmp_path):
    job, trained, root = cluster["job"], cluster["trained"], cluster["root"]
    text = ok(cli(cluster, "snapshot", job, "--tag", "t"))
    assert f"version {STEPS}" in text
    manifest = json.loads(ok(cli(cluster, "snapshot", job, "--tag", "t2", "--json")))
    assert manifest["version"] == STEPS and len(manifest["shards"]) == 2
    assert (root / job / "t" / "manifest.json").is_file()

    rows = json.loads(ok(cli(cluster, "snapshots", "--json")))
    mine = sorted((r["tag"], r["version"], r["num_servers"]) for r in rows if r["job"] == job)
    assert mine == [("t", STEPS, 2), ("t2", STEPS, 2)]
    assert "t2" in ok(cli(cluster, "snapshots", "--job", job))
    assert "t2" in ok(cli(cluster, "snapshots", job))  # JOB as the other tools take it

    # move the servers on one step, then restore the snapshot: back to the trained values
    def one_more(client: ShardClient) -> None:
        model, opt = wrap("zero1", client, job, initial_weights(torch.float32))
        assert model.step_count == STEPS
        train_steps(model, opt, client.rank, 2, batches(), range(STEPS, STEPS + 1))

    run_ranks(one_more, 2, cluster["addresses"])
    text = ok(cli(cluster, "restore", job, "--tag", "t"))
    assert "restored" in text and f"version {STEPS}" in text
    c = ShardClient(ClusterSpec(cluster["addresses"]), timeout_s=20.0)
    try:
        for name in ("wte.weight", "ln_f.weight"):
            np.testing.assert_array_equal(tools.get_param(c, job, name), trained[name].numpy())
    finally:
        c.close()

    live, offline = tmp_path / "m.safetensors", tmp_path / "m2.safetensors"
    ok(cli(cluster, "export", job, "--out", str(live)))
    ok(cli(cluster, "export", "--snapshot", str(root / job / "t"), "--out", str(offline)))
    for path in (live, offline):
        loaded = load_file(str(path))
        model = GPT(CFG)
        model.load_state_dict(loaded, strict=True)
        for name, value in trained.items():
            assert torch.equal(loaded[name], value), (path.name, name)


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "nosuchjob"],
        ["get", "nosuchjob", "wte.weight", "--out", "x.npy"],
        ["snapshot", "nosuchjob", "--tag", "t"],
        ["restore", "nosuchjob", "--tag", "t"],
        ["export", "nosuchjob", "--out", "x.safetensors"],
    ],
    ids=lambda a: a[0],
)
def test_unknown_job_is_one_line(cluster, tmp_path, args):
    proc = cli(cluster, *args, cwd=tmp_path)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nosuchjob" in lines[0], proc.stderr
    assert lines[0].startswith(f"paramshard {args[0]}: error:")
    assert not list(tmp_path.iterdir())  # nothing written


def test_unknown_parameter_and_bad_snapshot_folder(cluster, tmp_path):
    proc = cli(cluster, "get", cluster["job"], "nosuch.weight", "--out", str(tmp_path / "x.npy"))
    assert proc.returncode == 1 and "nosuch.weight" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    # a name as another model's code spells it: the error suggests the job's own
    proc = cli(cluster, "get", cluster["job"], "wte.weightt", "--out", str(tmp_path / "x.npy"))
    assert proc.returncode == 1 and "did you mean 'wte.weight'?" in proc.stderr, proc.stderr
    missing = cluster["root"] / cluster["job"] / "nosuchtag"
    proc = cli(cluster, "export", "--snapshot", str(missing), "--out", str(tmp_path / "m.st"))
    assert proc.returncode == 1 and str(missing / "manifest.json") in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["get", "JOB", "wte.weight", "--out", "missing/x.npy"], "no such folder"),
        (["export", "JOB", "--out", "missing/m.safetensors"], "no such folder"),
        (["export", "JOB", "--out", "."], "is a folder; give a file name"),
        (["export", "JOB", "--hf-dir", "afile/hf"], "no such folder"),
        (["export", "JOB", "--hf-dir", "afile"], "is a file; give a folder"),
    ],
    ids=["get-missing-folder", "export-missing-folder", "export-to-folder", "hf-under-file",
         "hf-is-file"],
)  # fmt: skip
def test_an_output_that_cannot_be_written_is_one_line(cluster, tmp_path, args, said):
    """A bad --out or --hf-dir printed a Python traceback (FileNotFoundError of a temporary
    file's name, IsADirectoryError), after the whole state was fetched; it is refused first."""
    (tmp_path / "afile").write_text("")
    args = [cluster["job"] if a == "JOB" else a for a in args]
    proc = cli(cluster, *args, cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], proc.stderr
    assert lines[0].startswith(f"paramshard {args[0]}: error: --")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing written
