"""Smoke tests of ``python -m benchmarks.readers --quick`` (a trainer alone and beside readers
through shared memory and in-band, on fresh servers, and a JSON that holds each condition's
step with its ratio to the trainer alone) and of ``benchmarks.segment_copies --quick``.
They check that the numbers are there and consistent, not how fast anything was."""

from __future__ import annotations

import pytest
from quick_benchmarks import run_quick


def test_quick_readers_benchmark_reports_every_condition() -> None:
    report = run_quick("benchmarks.readers")
    assert report["machine"]["cores"] >= 1 and report["machine"]["git"], report["machine"]
    setup = report["setup"]
    (rep,) = report["reps"]
    assert sorted(rep["order"]) == ["inband", "none", "shm"]
    for name, trial in rep["trials"].items():
        assert len(trial["steps_s"]) == setup["steps"]
        # a step is its three phases, timed back to back
        parts = trial["push_median"] + trial["step_median"] + trial["pull_median"]
        assert 0 < trial["s_median"] <= parts * 1.5 + 0.01, trial
        assert trial["cpu_s_per_step"]["server"] > 0, trial
        # readers pulled whole buffers while the trainer stepped, and only beside it
        assert ("reader_gb_per_s" in trial) == (name != "none"), trial
        if name != "none":
            assert trial["reader_pulls_per_s"] > 0 and "readers" in trial["cpu_s_per_step"]
    cells = report["cells"]
    assert cells["none"]["ratio_to_none"]["median"] == 1.0
    for name in ("shm", "inband"):
        want = rep["trials"][name]["s_median"] / rep["trials"]["none"]["s_median"]
        assert cells[name]["ratio_to_none"]["median"] == pytest.approx(want, abs=0.01)


def test_quick_segment_copies_benchmark_reports_every_way() -> None:
    report = run_quick("benchmarks.segment_copies")
    (rep,) = report["reps"]
    assert rep["alone"]["other_ops_per_s"] > 0 and rep["alone"]["copy_s"] == 0
    for way in ("memoryview", "copy_into", "encode"):
        assert rep[way]["copy_s"] > 0, rep
        want = rep[way]["other_ops_per_s"] / rep["alone"]["other_ops_per_s"]
        assert rep[way]["other_ratio_to_alone"] == pytest.approx(want, abs=1e-3)
        assert report["cells"][way]["copy_s"] == rep[way]["copy_s"]
