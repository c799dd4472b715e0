"""Runs a benchmark's ``--quick`` mode as a user would, for the smoke tests
(test_benchmarks_smoke.py, test_hybrid_smoke.py, test_scale_smoke.py), and the float32 bound
their losses are held to.

A benchmark runs in its own process group, so that on a timeout the whole group (benchmark,
trainers, servers, gloo ranks: every process it started) is stopped by id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import worker_env
from numerics import TWIN_FACTOR, TWIN_FLOOR

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # --quick takes < 2 (hybrid, each family: < 3) minutes on an idle 2-core machine


def run_quick(module: str = "benchmarks.strategies", *options: str) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--quick", *options],
        cwd=ROOT,
        env=worker_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this test started, by its id
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"benchmark still running after {TIMEOUT_S} s; stderr:\n{err[-3000:]}")
    assert proc.returncode == 0, f"rc={proc.returncode}\nstderr:\n{err[-3000:]}"
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        pytest.fail(f"stdout is not JSON:\n{out[-2000:]}\nstderr:\n{err[-2000:]}")


def assert_like_torch(row: dict) -> None:
    """Float32 losses: ours within max(TWIN_FLOOR, TWIN_FACTOR x torch's deviation) of
    single-process; torch's own far below any real error (a sanity check of the twin, not
    the bound: a twin that trained wrongly would loosen it)."""
    ours, theirs = row["loss_rel_diff_vs_single"], row["torch_loss_rel_diff_vs_single"]
    assert theirs < 1e-4, row
    assert ours <= max(TWIN_FLOOR, TWIN_FACTOR * theirs), (ours, theirs, row)
