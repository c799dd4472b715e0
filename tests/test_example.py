"""End to end: examples/train_gpt.py starts its own servers and ranks, and the loss goes down."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
TIMEOUT_S = 180


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,extra",
    [
        ("fsdp", ["--world-size", "2"]),
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
