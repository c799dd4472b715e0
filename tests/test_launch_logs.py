"""``paramshard launch --config FILE --log-dir DIR``: one file for every rank's configuration, and
every rank's output kept in torchrun's layout, ``DIR/<run_id>/attempt_<n>/<rank>/``, n counting
that rank's restarts (``--max-restarts``).

A real launcher run: two local servers, two ZeRO-2 ranks whose ``ShardingConfiguration.from_env``
reads the file the launcher hands them; rank 1 fails once after building its model, is restarted,
and its second life's output lands under ``attempt_1``. Every wait is bounded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_trainer_restart import launch_env  # the same clean environment for launch

from paramshard import cli
from paramshard.launch_files import RankLogs
from paramshard.protos.config_file import CONFIG_ENV

RUN_S = 240.0  # 2 servers, 2 ranks importing torch, one restart importing it again; 2 busy cores
pytestmark = pytest.mark.timeout(400)

TRAIN = r"""
import os, sys
import torch
from paramshard.client import restarts
from paramshard.strategies import ShardingConfiguration, ZeRO2Model, ZeRO2Optimizer

torch.set_num_threads(1)
config = ShardingConfiguration.from_env(timeout_s=90.0)  # job and accumulation: from the file
life = restarts.restart_count()
print(f"CONFIG {config.job} {config.gradient_accumulation_steps} {config.timeout_s} life {life}",
      flush=True)
torch.manual_seed(0)
model = ZeRO2Model(torch.nn.Linear(8, 2), config)
opt = ZeRO2Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
if config.rank == 1 and life == 0:  # its model declared its state on the servers: restartable
    print("dying on purpose", file=sys.stderr, flush=True)
    sys.exit(3)
for step in range(model.step_count, 2):
    for micro in range(config.gradient_accumulation_steps):
        g = torch.Generator().manual_seed(100 * step + 10 * micro + config.rank)
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()
print(f"DONE rank {config.rank}", flush=True)
"""


def _launch(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``paramshard launch ARGV``, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "paramshard", "launch", *argv],
        cwd=cwd,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=RUN_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_config_file_and_log_dir_across_a_restart(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    config = tmp_path / "sharding.toml"
    config.write_text('job = "logs-job"\ngradient_accumulation_steps = 2\ntimeout_s = 5.0\n')
    logs = tmp_path / "logs"
    result = _launch(
        "--nproc", "2", "--max-restarts", "1", "--run-id", "logs-run",
        "--config", str(config.relative_to(tmp_path)), "--log-dir", str(logs), str(script),
        cwd=tmp_path,  # --config given relative: the ranks get its absolute path
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    run = logs / "logs-run"
    files = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    assert files == [
        f"attempt_{a}/{r}/{s}.log"
        for a, r in [(0, 0), (0, 1), (1, 1)]  # rank 0 ran once, rank 1 twice
        for s in ("stderr", "stdout")
    ]

    def read(attempt: int, rank: int, stream: str) -> list[str]:
        return (run / f"attempt_{attempt}" / str(rank) / f"{stream}.log").read_text().splitlines()

    # the file's values reached every rank; the script's keyword argument won over timeout_s
    for attempt, rank in [(0, 0), (0, 1), (1, 1)]:
        assert f"CONFIG logs-job 2 90.0 life {attempt}" in read(attempt, rank, "stdout")
    assert read(0, 1, "stderr") == ["dying on purpose"]  # the bytes as printed, no prefix
    assert "DONE rank 1" not in read(0, 1, "stdout")
    assert read(1, 1, "stdout")[-1] == "DONE rank 1"
    assert read(0, 0, "stdout")[-1] == "DONE rank 0"
    # the console still shows every line, prefixed, as without --log-dir
    assert "[rank 1] dying on purpose" in result.stderr.splitlines()
    assert "[rank 1] DONE rank 1" in result.stdout.splitlines()
    assert f"rank output also goes to {run}/attempt_N/RANK/" in result.stderr


def test_redirects_keeps_rank_output_off_the_console(tmp_path: Path) -> None:
    """``--redirects``: the files get every line, the console none (the launcher's own lines,
    prefixed ``[launch]``, stay)."""
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint('OUT line')\nprint('ERR line', file=sys.stderr)\n")
    logs = tmp_path / "logs"
    result = _launch(
        "--nproc", "1", "--run-id", "quiet", "--log-dir", str(logs), "--redirects", str(script)
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rank0 = logs / "quiet" / "attempt_0" / "0"
    assert (rank0 / "stdout.log").read_text() == "OUT line\n"
    assert (rank0 / "stderr.log").read_text() == "ERR line\n"
    assert "line" not in result.stdout + result.stderr.replace("stdout.log, stderr.log", "")
    assert f"rank output only goes to {logs / 'quiet'}/attempt_N/RANK/" in result.stderr


def test_rank_logs_layout_and_append(tmp_path: Path) -> None:
    logs = RankLogs.create(str(tmp_path / "d"), "r7")
    assert logs is not None and logs.root == str(tmp_path / "d" / "r7")
    for text in (b"one\n", b"two\n"):  # a second launch with the same run id appends
        out, err = logs.open(3, 2)
        out.write(text)
        out.close()
        err.close()
    assert (tmp_path / "d/r7/attempt_2/3/stdout.log").read_bytes() == b"one\ntwo\n"
    assert (tmp_path / "d/r7/attempt_2/3/stderr.log").read_bytes() == b""
    assert RankLogs.create(None, "r7") is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "{tmp}/none.toml"], "--config: cannot read config file {tmp}/none.toml"),
        (["--config", "{tmp}/c.ini"], "--config: config file {tmp}/c.ini: cannot tell its format"),
        (["--config", "{tmp}/bad.json"], "--config: config file {tmp}/bad.json is not valid JSON"),
        (["--log-dir", "{tmp}", "--run-id", ".."], "--log-dir: the run id '..' cannot name"),
        (["--log-dir", "{tmp}/file", "--run-id", "r"], "--log-dir: cannot create {tmp}/file/r"),
        (["--redirects"], "--redirects needs --log-dir"),
    ],
)
def test_usage_errors(
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys,
    monkeypatch,  # noqa: ANN001
) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    (tmp_path / "c.ini").write_text("job = x\n")
    (tmp_path / "bad.json").write_text("{job: 1}")
    (tmp_path / "file").write_text("")
    script = tmp_path / "s.py"
    script.write_text("")
    tmp = str(tmp_path)
    argv = [a.replace("{tmp}", tmp) for a in argv]
    assert cli.main(["launch", "--nproc", "1", *argv, str(script)]) == 2
    assert message.replace("{tmp}", tmp) in capsys.readouterr().err
