"""Smoke test of ``python -m benchmarks.collectives --quick``: every collective at every world
size runs on both sides, each side's result is checked against the expected values, and the
JSON carries the times, their ratio and the transport's rates the cost model reads.

The full run (links shaped to 10 and 25 Gbit/s in network namespaces, 15 minutes) is run by
hand (docs/scaling.md); this one runs on loopback, as a user's first try would."""

from __future__ import annotations

import pytest
from quick_benchmarks import run_quick

OPS = ("all_reduce", "all_gather", "reduce_scatter")


@pytest.mark.slow
def test_quick_collectives_benchmark_reports_every_cell_verified() -> None:
    report = run_quick("benchmarks.collectives")
    cells = {(r["op"], r["world_size"]): r for r in report["results"]}
    assert {op for op, _ in cells} == set(OPS), sorted(cells)
    assert {w for _, w in cells} == {2, 4}, sorted(cells)
    for key, row in cells.items():
        assert row["ours_verified"] and row["gloo_verified"], (key, row)
        assert row["ours_ms"] > 0 and row["gloo_ms"] > 0, (key, row)
        assert row["ratio_vs_gloo"] == pytest.approx(row["ours_ms"] / row["gloo_ms"], rel=1e-2)
        low, high = row["ours_ms_min_max"]
        assert low <= row["ours_ms"] <= high, (key, row)
    assert report["tcp_gbps"] > 0 and report["push_pull"]["push_pull_gbps"] > 0
    assert all(p["seconds"] > 0 for p in report["phases"]), report["phases"]
    for p in report["phases"]:  # ours' phases: each rank's unary round trip; gloo's: none
        rtt = p.get("status_rtt_ms")
        assert (rtt is None) == p["variant"].startswith("gloo"), p
        assert rtt is None or (len(rtt) == p["world_size"] and all(t > 0 for t in rtt)), p
