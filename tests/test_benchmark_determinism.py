"""Smoke test of ``python -m benchmarks.determinism``: it runs, and its JSON is complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import worker_env

ROOT = Path(__file__).resolve().parents[1]


def test_determinism_benchmark_reports_both_orders() -> None:
    cmd = [sys.executable, "-m", "benchmarks.determinism", "--sizes", "1", "--world-sizes", "3"]
    proc = subprocess.run(
        [*cmd, "--reps", "2"],
        check=False,  # the return code is asserted with stderr in the message
        cwd=ROOT,
        env=worker_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    assert {r["op"] for r in rows} == {"all_reduce", "push"}
    for r in rows:
        assert r["world"] == 3 and r["mib"] == 1 and r["contributions_mib"] == 3
        for key in ("arrival_order", "rank_order"):
            assert r[f"{key}_ms"] > 0 and r[f"{key}_peak_mib"] > 0, r
        assert r["time_ratio"] > 0
