"""Issue 26, requirement 5: README's "Look into it while it trains" commands, exactly as written
there, against a job started README's way (``paramshard launch --nproc 2 train.py``), with no
address typed: the tools find the run through launch's run file, and launch's local servers
have a snapshot directory.

The commands are read from the README itself (``JOB`` replaced by the job's name) and run as
``python -m paramshard ...`` while two FSDP ranks train. ``restore`` runs once the ranks stopped
stepping and closed their clients (README says so: a restore puts the servers back at the
snapshot's step, under ranks that would go on from theirs, and the servers refuse it while
ranks of the job's run hold leases). The export that follows must equal the snapshot, which
is also exported offline from its folder under the run directory (a copy taken before the
``delete-snapshot`` removes it); ``drop``, the last, takes the job off the servers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paramshard.server import MALLOC_ENV

ROOT = Path(__file__).resolve().parents[1]
JOB = "readme"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRAIN = r"""
import os, sys, time
from pathlib import Path
import numpy as np
import torch
from paramshard.strategies import ShardingConfiguration, FSDPModel, FSDPOptimizer

here = Path(sys.argv[1])
config = ShardingConfiguration.from_env(job=sys.argv[2])
torch.manual_seed(0)
model = FSDPModel(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)), config)
opt = FSDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), config)
step, deadline = 0, time.monotonic() + 400
while time.monotonic() < deadline:
    # the ranks agree on when to stop, as with torch.distributed: a rank that saw the file a
    # step before the other would leave it waiting for its gradient in a step it never runs
    seen = np.array([(here / "stop").exists()], dtype=np.int64)
    if config.client.all_reduce(seen, "max")[0]:
        break
    torch.manual_seed(1000 * step + config.client.rank)
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    step += 1
    time.sleep(0.01)
print(f"stopped at step {step}", flush=True)
rank = config.client.rank
config.client.close()  # its lease goes: a restore from outside is refused while ranks hold one
(here / f"stopped-{rank}").touch()
while not (here / "exit").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def readme_commands() -> list[list[str]]:
    """The commands of README's "Look into it" block, comments dropped, JOB filled in."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Look into it while it trains\n+```\n(.*?)```", text, re.S)
    assert block, "README has no 'Look into it while it trains' block"
    commands = []
    for line in block.group(1).splitlines():
        words = shlex.split(line.split("#", 1)[0])
        if words:
            assert words[0] == "paramshard", line
            commands.append([JOB if w == "JOB" else w for w in words[1:]])
    return commands


def wait_stopped(here: Path, launch: subprocess.Popen) -> None:
    """Until both ranks have left their training loop: a fixed sleep is not enough on a loaded
    machine, where a rank's last step can take longer (CI met a restore under a rank still
    waiting for its step's reduced gradient)."""
    deadline = time.monotonic() + 120
    while not all((here / f"stopped-{rank}").exists() for rank in range(2)):
        assert launch.poll() is None, launch.communicate()
        assert time.monotonic() < deadline, "the ranks did not stop stepping within 120 s"
        time.sleep(0.1)


def test_readme_commands_against_a_launched_job(tmp_path: Path) -> None:
    commands = readme_commands()
    names = ["status", "inspect", "snapshot", "restore", "export", "delete-snapshot", "drop"]
    assert [c[0] for c in commands] == names
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in MALLOC_ENV and not k.startswith("PARAMSHARD_") and k != "RANK"
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    runs = tmp_path / "runs"
    env["PARAMSHARD_RUN_DIR"] = str(runs)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    launch = subprocess.Popen(
        [sys.executable, "-m", "paramshard", "launch", "--nproc", "2", str(script),
         str(tmp_path), JOB],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def paramshard(args: list[str]) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "paramshard", *args],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert out.returncode == 0, f"paramshard {' '.join(args)}:\n{out.stdout}{out.stderr}"
        assert "using run run-" in out.stderr  # found through the run file, no address typed
        return out.stdout

    try:
        deadline = time.monotonic() + 300
        while True:  # until the job has trained a few steps
            assert launch.poll() is None, launch.communicate()
            assert time.monotonic() < deadline, "the job did not start training"
            if list(runs.glob("*.json")):
                status = json.loads(paramshard(["status", "--json"]))
                versions = [
                    int(b.get("version", 0))
                    for row in status
                    for job in row.get("jobs", [])
                    if job["job"] == JOB
                    for b in job.get("buffers", [])
                ]
                if versions and min(versions) >= 3:
                    break
            time.sleep(0.5)
        outputs = {}
        for args in commands:
            if args[0] == "restore":
                (tmp_path / "stop").touch()
                wait_stopped(tmp_path, launch)  # the ranks' last step ended
            if args[0] == "delete-snapshot":  # the snapshot, kept for the offline export
                (taken,) = runs.glob(f"*/snapshots/{JOB}/{args[args.index('--tag') + 1]}")
                shutil.copytree(taken, tmp_path / "kept" / JOB / taken.name)  # <dir>/<job>/<tag>
            outputs[args[0]] = paramshard(args)
        (tmp_path / "exit").touch()
        out, err = launch.communicate(timeout=120)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.communicate(timeout=30)
    assert launch.returncode == 0, out + err
    stopped = re.findall(r"\[rank \d\] stopped at step (\d+)", out + err)
    assert len(stopped) == 2 and len(set(stopped)) == 1, out + err  # both left after one step
    servers = re.search(r"started 2 shard servers: (\S+), (\S+)", err)
    assert servers, err
    for address in servers.groups():  # one row per server, healthy
        assert re.search(rf"^{re.escape(address)}\s+ok\s", outputs["status"], re.M), outputs
    assert "NAME" in outputs["inspect"] and "yes" in outputs["inspect"]
    snap = re.search(r"snapshot readme/(\S+): version (\d+)", outputs["snapshot"])
    assert snap, outputs["snapshot"]
    tag, version = snap.group(1), int(snap.group(2))
    assert f"restored {JOB}/{tag} at version {version}" in outputs["restore"]
    assert list(runs.glob("*.json")) == [], "launch removes its run file at exit"
    assert f"deleted {JOB}/{tag}: 3 files" in outputs["delete-snapshot"], outputs
    assert list(runs.glob(f"*/snapshots/{JOB}/{tag}")) == [], "the tag's folder went with it"
    assert outputs["drop"].strip() == f"dropped {JOB}", outputs
    folder = tmp_path / "kept" / JOB / tag
    exported = next(a[a.index("--out") + 1] for a in commands if a[0] == "export")
    offline = tmp_path / "offline.safetensors"
    subprocess.run(
        [sys.executable, "-m", "paramshard", "export", "--snapshot", str(folder), "--out",
         str(offline)],
        cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    from safetensors.numpy import load_file

    live, snapshot = load_file(str(tmp_path / exported)), load_file(str(offline))
    assert sorted(live) == sorted(snapshot) and live
    for name, values in snapshot.items():
        assert (live[name] == values).all(), f"{name}: the restored job differs from the snapshot"
