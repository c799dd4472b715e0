"""End to end: examples/train_gpt.py hands itself to ``paramshard launch`` (servers and ranks),
shows rank 0's progress, and the loss goes down."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from subprocess import DEVNULL

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
TIMEOUT_S = 180


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,extra",
    [
        ("fsdp", ["--world-size", "2"]),
        ("fsdp", ["--world-size", "3", "--elastic", "--min-nproc", "2"]),  # parts 6, 5, 5
        ("ddp", ["--world-size", "2"]),
        ("hybrid", ["--world-size", "4", "--pp", "2", "--tp", "2", "--schedule", "gpipe"]),
    ],
)
def test_train_gpt_loss_goes_down(strategy: str, extra: list[str]) -> None:
    cmd = [sys.executable, str(SCRIPT), "--strategy", strategy, *extra, "--steps", "20"]
    proc = subprocess.run(
        cmd,
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    m = re.search(r"first loss ([\d.]+) -> last loss ([\d.]+)", proc.stdout)
    assert m, output[-3000:]
    first, last = float(m.group(1)), float(m.group(2))
    assert last < first, output[-3000:]
    assert "[rank 0] sample: " in proc.stdout
    # tqdm, one line every --log-every (10) steps since the output is not a terminal
    assert re.search(r"^\[rank 0\] step   10/20, loss=[\d.]+  \[", proc.stdout, re.M), output
    if strategy != "hybrid":  # validation runs with the data-parallel strategies
        assert "[rank 0] step 20: validation loss " in proc.stdout
    assert "[rank 0] steps 1..20 trained (continuous), the servers at version 20;" in proc.stdout


@pytest.mark.slow
def test_a_run_too_short_to_judge_its_loss_succeeds() -> None:
    """``--steps 5``: the first and the last five losses were the same five, so "the loss did
    not go down" and the script exited 1 (a walkthrough's: it would fail a Kubernetes Job)."""
    cmd = [sys.executable, str(SCRIPT), "--strategy", "fsdp", "--world-size", "2", "--steps", "5"]
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=DEVNULL
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "[rank 0] OK: 5 steps are too few to judge the loss" in proc.stdout, output[-3000:]


@pytest.mark.slow
def test_an_elastic_rank_that_comes_once_the_job_ended_exits_cleanly(servers) -> None:
    """A rank restarted (``--max-restarts``) as the others finish the last step resumes at
    that step and trains nothing: it exits 0. It raised AttributeError at its end (the last
    step's leader reports; it had joined no step), seen in a field run."""
    addresses = ",".join(s.address for s in servers(2))
    env = {**os.environ, "PARAMSHARD_RUN": f"ended-{os.getpid()}"}
    env.pop("RANK", None)
    argv = [sys.executable, str(SCRIPT), "--elastic", "--min-nproc", "1", "--steps", "10"]
    run = dict(capture_output=True, text=True, timeout=TIMEOUT_S, stdin=DEVNULL)
    job = subprocess.run([*argv, "--servers", addresses], check=False, env=env, **run)
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    assert "steps 1..10 trained (continuous), the servers at version 10;" in job.stdout
    late = {**env, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
            "PARAMSHARD_SERVERS": addresses, "PARAMSHARD_ELASTIC": "1",
            "PARAMSHARD_MIN_NPROC": "1", "PARAMSHARD_RESTART_COUNT": "1"}  # fmt: skip
    rank1 = subprocess.run(argv, check=False, env=late, **run)
    output = rank1.stdout + rank1.stderr
    assert rank1.returncode == 0, output[-3000:]
    assert "rank 1: resumed at step 10, the servers' step (restart 1)" in rank1.stdout, output


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--strategy", "hybrid", "--world-size", "4", "--pp", "2", "--target-loss", "2"],
         "--target-loss: validation runs with ddp, zero1, zero2 and fsdp"),
        (["--eval-every", "0"], "--eval-every must be >= 1"),
        (["--batch-size", "15"], "--batch-size 15 must be a positive multiple of --world-size 2"),
        (["--strategy", "ddp", "--elastic"],
         "--elastic needs zero1, zero2 or fsdp: ddp keeps state in its ranks"),
    ],
)  # fmt: skip
def test_train_gpt_refuses_bad_arguments(argv, message, capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as `python examples/train_gpt.py` does
    import train_gpt

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exc:
        train_gpt.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
