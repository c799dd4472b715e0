"""Losing a trainer loses no work: ``paramshard launch --max-restarts`` restarts a dead rank.

Real processes through the launcher: a small script trains an MLP with ZeRO-2 or FSDP and rank
1 SIGKILLs itself at a chosen point of a chosen step in its first life. The launcher starts it
again; it adopts the servers' step, replays what is missing, and the final parameters equal an
uninterrupted run's bit for bit (rank-order sums make every step reproducible, and a replayed
gradient is the same one). A DDP rank keeps its state in its process, so the launcher stops
the job instead of restarting it. Every wait is bounded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from paramshard.client import ClusterSpec, ShardClient, restarts
from paramshard.restarts import RankRestarts
from paramshard.server import MALLOC_ENV
from paramshard.strategies import DDPModel, ShardingConfiguration, ZeRO2Model

ROOT = Path(__file__).resolve().parents[1]
RUN_S = 180.0  # one launcher run: 2 servers, 2 ranks importing torch, one restart, 2 cores
pytestmark = pytest.mark.timeout(600)

TRAIN = r"""
import os, signal, sys, time
import torch
from paramshard.client import restarts
from paramshard.strategies import (DDPModel, DDPOptimizer, FSDPModel, FSDPOptimizer,
                                   ShardingConfiguration, ZeRO2Model, ZeRO2Optimizer)

strategy, steps, die_at, when, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
torch.set_num_threads(1)
config = ShardingConfiguration.from_env(job="mlp-" + os.environ["PARAMSHARD_RUN"], timeout_s=90.0)
rank = config.rank
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                          torch.nn.Tanh(), torch.nn.Linear(64, 4))
if strategy == "fsdp":
    model = FSDPModel(net, config, wrap=(torch.nn.Linear,))
    opt = FSDPOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
elif strategy == "zero2":
    model = ZeRO2Model(net, config)
    opt = ZeRO2Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
else:
    model = DDPModel(net, config)
    opt = DDPOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
start = getattr(model, "step_count", 0)
print(f"START {start} life {restarts.restart_count()} at {time.time():.3f}", flush=True)
dying = rank == 1 and restarts.restart_count() == 0
for step in range(start, steps):
    g = torch.Generator().manual_seed(1000 * step + rank)  # the same batch for the same step
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if dying and step == die_at and when == "before-backward":
        print(f"KILL at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    if dying and step == die_at and when == "after-backward":
        model.synchronize_gradients()  # all its gradients of this step are on the servers
        print(f"KILL at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if strategy == "fsdp":
        model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
state = model.state_dict()
if rank == 0:
    torch.save(state, out)
print("DONE", flush=True)
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("restart") / "train.py"
    path.write_text(TRAIN)
    return path


def launch_env() -> dict[str, str]:
    """The test's environment without MALLOC_* and PARAMSHARD_* (launch must set them)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in MALLOC_ENV and not k.startswith("PARAMSHARD_") and k != "RANK"
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def launch(*args: str | Path, timeout: float = RUN_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "paramshard", "launch", "--nproc", "2", *map(str, args)],
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def lines_of(rank: int, word: str, stdout: str) -> list[str]:
    return re.findall(rf"^\[rank {rank}\] {word} (.*)$", stdout, re.M)


@pytest.mark.parametrize(
    ("strategy", "when"),
    [
        ("zero2", "after-backward"),  # its gradients are in: the others step without it
        ("fsdp", "before-backward"),  # they are not: the others wait, it replays the step
    ],
)
def test_killed_rank_resumes_at_the_servers_step_bitwise(
    script: Path, tmp_path: Path, strategy: str, when: str
) -> None:
    steps, die_at = 8, 3
    whole, restarted = tmp_path / "uninterrupted.pt", tmp_path / "restarted.pt"
    base = launch("--max-restarts", "1", script, strategy, steps, -1, when, whole)
    assert base.returncode == 0, base.stdout[-3000:] + base.stderr[-3000:]

    began = time.monotonic()
    run = launch("--max-restarts", "1", script, strategy, steps, die_at, when, restarted)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "rank 1 failed with exit code 137; restarting it" in run.stderr

    starts = lines_of(1, "START", run.stdout)
    assert len(starts) == 2, run.stdout  # its first life and the restarted one
    step, life, at = re.fullmatch(r"(\d+) life (\d+) at ([\d.]+)", starts[1]).groups()
    # before backward the servers wait at die_at for its gradient; after, they step without it
    assert int(step) == die_at + (when == "after-backward"), run.stdout
    assert int(life) == 1
    (killed,) = lines_of(1, "KILL at", run.stdout)
    print(
        f"{strategy}: rank 1 killed {when} step {die_at}, back at step {step}"
        f" {float(at) - float(killed):.1f} s after its SIGKILL;"
        f" the run took {time.monotonic() - began:.1f} s"
    )
    assert len(lines_of(0, "START", run.stdout)) == 1  # rank 0 kept running

    a, b = torch.load(whole), torch.load(restarted)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), (name, (a[name] - b[name]).abs().max())


def test_ddp_rank_is_not_restarted_and_the_job_stops(script: Path, tmp_path: Path) -> None:
    began = time.monotonic()
    run = launch("--max-restarts", "2", script, "ddp", 8, 3, "before-backward", tmp_path / "x")
    took = time.monotonic() - began
    assert run.returncode == 128 + signal.SIGKILL, run.stdout[-3000:] + run.stderr[-3000:]
    assert (
        "rank 1 failed with exit code 137 (not restarted: its ddp model kept parameters and"
        " optimizer state in the trainer process" in run.stderr
    ), run.stderr[-3000:]
    assert len(lines_of(1, "START", run.stdout)) == 1  # never started again
    assert "DONE" not in run.stdout  # rank 0 was stopped, not left to train on
    assert "does not apply to ddp" in run.stderr  # rank 0 was warned at the start
    print(f"ddp: the launcher stopped the job {took:.1f} s after it started")


def test_restarted_rank_refuses_to_build_a_trainer_side_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever restarts a rank, a DDP model built in it refuses with the reason, while a
    ZeRO model is built and says its state is on the servers."""
    declared = tmp_path / "rank-1"
    monkeypatch.setenv(restarts.MAX_RESTARTS_ENV, "3")
    monkeypatch.setenv(restarts.RESTART_COUNT_ENV, "1")
    monkeypatch.setenv(restarts.RESTART_FILE_ENV, str(declared))
    client = ShardClient(ClusterSpec(["127.0.0.1:1"]), rank=1, world_size=2)  # never called
    config = ShardingConfiguration(client, job="refuse")
    ZeRO2Model(torch.nn.Linear(2, 2), config)
    assert restarts.read_declaration(str(declared)).restartable
    with pytest.raises(RuntimeError, match="rank 1 was restarted .* ddp model keeps its"):
        DDPModel(torch.nn.Linear(2, 2), config)
    said = restarts.read_declaration(str(declared))
    assert said.strategies == ("zero2", "ddp") and not said.restartable


def test_restart_budget_and_declarations(tmp_path: Path) -> None:
    policy = RankRestarts(2, str(tmp_path))
    assert policy.env(1) == {
        restarts.MAX_RESTARTS_ENV: "2",
        restarts.RESTART_COUNT_ENV: "0",
        restarts.RESTART_FILE_ENV: str(tmp_path / "rank-1"),
        restarts.LAUNCH_ENV: policy.launch,  # the same for every rank and restart
    }
    assert len(policy.launch) == 16 and policy.launch != RankRestarts(2).launch
    assert "before building a sharded model" in policy.refusal(1)
    (tmp_path / "rank-1").write_text("hybrid trainers\nzero1 servers\n")  # a 3D rank
    assert "its hybrid model kept" in policy.refusal(1)
    (tmp_path / "rank-0").write_text("fsdp servers\n")
    assert policy.refusal(0) is None
    assert policy.count(0) == 1 and policy.count(0) == 2
    assert policy.env(0)[restarts.RESTART_COUNT_ENV] == "2"
    assert "--max-restarts 2 used up" in policy.refusal(0)
    assert RankRestarts(0).env(0) == {} and RankRestarts(0).refusal(0) == ""
    # without --max-restarts a rank still declares itself: a rank whose own code raised says
    # so, and the launcher names it rather than a rank its notice stopped first
    launched = RankRestarts.create(0)
    try:
        assert launched.env(3) == {restarts.RESTART_FILE_ENV: f"{launched.directory}/rank-3"}
        assert launched.refusal(3) == ""
    finally:
        launched.close()


# -------------------------------------------------------------------------------- the example
def _ends(text: str, chars: int = 3000) -> str:
    """The first and last ``chars`` of a launcher's output: where a failure began (the first
    recovery's lines) as well as how it ended."""
    if len(text) <= 2 * chars:
        return text
    return f"{text[:chars]}\n[...]\n{text[-chars:]}"


def _pid_of(run_id: str, rank: int) -> int | None:
    """The trainer process of ``rank`` in launcher run ``run_id`` (from /proc)."""
    want = {f"PARAMSHARD_RUN={run_id}".encode(), f"RANK={rank}".encode()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = set((entry / "environ").read_bytes().split(b"\0"))
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if want <= env and b"train_gpt.py" in cmdline:
            return int(entry.name)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank in /proc")
def test_train_gpt_resumes_a_killed_rank(tmp_path: Path) -> None:
    run_id = f"restart-{os.getpid()}"
    cmd = [
        sys.executable, "-m", "paramshard", "launch", "--nproc", "2", "--max-restarts", "1",
        "--run-id", run_id, "examples/train_gpt.py", "--strategy", "fsdp", "--steps", "30",
    ]  # fmt: skip
    out = tmp_path / "out.txt"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=launch_env(), stdout=sink, stderr=subprocess.STDOUT, text=True
        )
        try:
            deadline = time.monotonic() + RUN_S
            while "step   10/30" not in out.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
                time.sleep(0.1)
            pid = _pid_of(run_id, 1)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            assert proc.wait(timeout=RUN_S) == 0, _ends(out.read_text())
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = out.read_text()
    assert "rank 1 failed with exit code 137; restarting it" in text
    resumed = re.search(r"^\[rank 1\] rank 1: resumed at step (\d+)", text, re.M)
    # at the servers' step: past 10, where the kill came, and how far past depends on the
    # machine (rank 0 runs ~20 steps a second; 13 once in CI, where this said at most 12);
    # nothing lost or trained twice: every step once, the servers at the last
    assert resumed and 10 <= int(resumed.group(1)) < 30, text[-3000:]
    assert "steps 1..30 trained (continuous), the servers at version 30" in text, text[-3000:]
    assert "; 0 steps replayed" in text, text[-3000:]
    assert "[rank 0] OK: the loss went down" in text
