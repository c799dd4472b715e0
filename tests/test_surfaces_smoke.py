"""Smoke test of ``python -m benchmarks.surfaces --quick``: one repetition of every cell
(training with and without replicas, snapshot, offline and live export, restore onto 4
servers, the torch reference) on the 0.1M-parameter GPT-2, and a JSON that holds every number
with its ratio to the reference. Checks that the numbers are there and plausible, not how
fast anything was.

Runs the benchmark as a user would, in its own process group (stopped by its id on a
timeout)."""

from __future__ import annotations

import math

import pytest
from quick_benchmarks import run_quick

SPREAD = ("values", "median", "min", "max")


def _cell(stat: dict, reps: int) -> float:
    assert set(SPREAD) <= set(stat) and len(stat["values"]) == reps, stat
    assert stat["min"] <= stat["median"] <= stat["max"], stat
    return stat["median"]


@pytest.mark.slow
def test_quick_surfaces_benchmark_reports_every_cell() -> None:
    report = run_quick("benchmarks.surfaces")
    assert report["machine"]["cores"] >= 1 and report["machine"]["git"], report["machine"]
    psi, reps = report["model"]["n_params"], len(report["reps"])
    assert reps == 1 and psi > 0
    rep = report["reps"][0]
    with_, without = rep["runs"]["with"], rep["runs"]["without"]

    # the same steps on the same batches: replicas change the time, never the losses
    assert with_["losses"] == without["losses"] and all(map(math.isfinite, with_["losses"]))
    assert with_["recoveries"] == without["recoveries"] == 0
    assert all(0.0 <= run["foreign_cpu_frac"] <= 1.0 for run in (with_, without))
    # replicas were made every step (each server: its own copy and its neighbour's), and none
    # without them
    for server in with_["replicas"]:
        assert server["failure"] == "" and {r["own"] for r in server["held"]} == {True, False}
    assert all(not s["held"] for s in without["replicas"]), without["replicas"]

    cells = report["cells"]
    rep_cell = cells["replicas"]
    step_with, step_without = (_cell(rep_cell[k], reps) for k in ("step_s_with", "step_s_without"))
    assert step_with > 0 and step_without > 0
    assert _cell(rep_cell["ratio_with_to_without"], reps) == pytest.approx(
        step_with / step_without, abs=0.01
    )
    # each server holds at least its slice's state (16 bytes a parameter / 2), and below
    # several times it (the tiny model's state is small beside a server's interpreter)
    for key in ("server_peak_vs_formula_without", "server_peak_vs_formula_with"):
        assert 0.9 < _cell(rep_cell[key], reps) < 3.0, rep_cell[key]
    assert _cell(rep_cell["server_peak_with_to_without"], reps) >= 0.95

    # a snapshot holds params and both moments: at least 12 bytes a parameter in its shards
    assert rep["snapshot"]["shards"] == 2 and rep["snapshot"]["shard_bytes"] >= 12 * psi
    snap = cells["snapshot"]
    assert _cell(snap["wall_s"], reps) > 0 and _cell(snap["reference_torch_save_s"], reps) > 0
    assert _cell(snap["ratio_to_torch_save"], reps) > 0
    assert _cell(snap["server_rss_rise_mb"], reps) >= 0

    # both exports wrote the same tensors, as many bytes as save_file's file of the state dict
    export = cells["export"]
    assert export["same_tensors_offline_and_live"] is True
    ref = rep["reference"]
    assert ref["n_params"] == psi
    assert abs(rep["export"]["file_bytes"] - ref["save_file"]["file_bytes"]) < 2**16, rep
    for kind in ("offline", "live"):
        got = export[kind]
        assert _cell(got["wall_s"], reps) > 0 and _cell(got["ratio_to_save_file_s"], reps) > 0
        assert _cell(got["peak_rss_mb"], reps) > _cell(got["rss_rise_mb"], reps) >= 0
        assert _cell(got["rss_rise_to_largest_tensor"], reps) >= 0
    assert 0 < rep["export"]["largest_tensor_mb"] < rep["export"]["file_bytes"] / 2**20

    restore = cells["restore"]
    assert _cell(restore["wall_s"], reps) > 0 and _cell(restore["ratio_to_torch_load"], reps) > 0
    assert len(rep["restore"]["server_peak_rss_mb"]) == report["setup"]["restore_servers"] == 4
    share = rep["snapshot"]["shard_bytes"] / 4 / 2**20
    assert _cell(restore["share_mb"], reps) == pytest.approx(share, abs=0.1)
    # a restored server holds at least its share of the snapshot beside its idle self
    assert _cell(restore["server_peak_vs_share"], reps) >= 0.95
