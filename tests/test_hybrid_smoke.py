"""Smoke tests of ``python -m benchmarks.hybrid --quick`` (pipeline, tensor and 3D cells of the
example GPT and of HF Llama against torch's): they run, and their JSON is complete. A file of
their own, so that a test runner's workers can run them beside test_benchmarks_smoke.py's.
"""

from __future__ import annotations

import math

import pytest
from numerics import TWIN_FACTOR, TWIN_FLOOR
from quick_benchmarks import assert_like_torch, run_quick

HYBRID_CELLS = {"pp_gpipe": (4, 1, 1), "pp_1f1b": (4, 1, 1), "tp": (1, 4, 1), "3d": (2, 2, 1)}
LLAMA_CELLS = {"3d": (2, 2, 1)}


def assert_cell(row: dict, layout: tuple[int, int, int]) -> None:
    """A measured cell: both sides ran, at ``layout``, training correctly; the first step's
    loss agrees between them (the same weights and batch: within both deviations from
    single-process, each bounded as in ``assert_like_torch``)."""
    pp, tp, dp = layout
    assert row["error"] is None and "skipped" not in row, row
    assert row["layout"] == {"pp": pp, "tp": tp, "dp": dp}, row
    assert row["ours_ms"] > 0 and row["torch_ms"] > 0, row
    assert math.isfinite(row["ratio"]) and row["ratio"] > 0, row
    assert row["ratio"] == pytest.approx(row["ours_ms"] / row["torch_ms"], rel=0.02)
    for side in ("ours", "torch"):  # each rank's optimizer step: a part of its step
        opt = row[f"{side}_optimizer_ms"]
        assert len(opt) == pp * tp * dp and all(0 < t < row[f"{side}_ms"] for t in opt), row
    # both sides train correctly: ours no further from single-process than torch's twin
    assert_like_torch(row)
    first, theirs = row["first_step_loss"], row["torch_loss_rel_diff_vs_single"]
    assert first["ours_vs_torch_rel_diff"] <= max(TWIN_FLOOR, TWIN_FACTOR * theirs) + theirs, row
    if pp == 1:
        assert "bubble" not in row
        return
    bubble = row["bubble"]
    m = row["micro_batches"]
    assert bubble["theoretical_fraction"] == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-3)
    assert bubble["paper_ratio"] == pytest.approx((pp - 1) / m, abs=1e-3)
    assert len(bubble["per_stage"]) == pp * tp * dp
    assert {s["stage"] for s in bubble["per_stage"]} == set(range(pp))
    for s in [bubble, *bubble["per_stage"]]:
        key = "measured_fraction_mean" if s is bubble else "measured_fraction"
        assert 0.0 <= s[key] <= 1.0, s


def family_rows(report: dict, family: str) -> list[dict]:
    rows = [r for r in report["results"] if r["family"] == family]
    assert {(r["model"], r["world_size"]) for r in rows} == {("tiny", 4)}
    single = [r for r in rows if r["cell"] == "single"]
    assert len(single) == 1 and single[0]["torch_ms"] > 0 and single[0]["error"] is None
    return rows


@pytest.mark.slow
def test_quick_hybrid_benchmark_reports_every_cell() -> None:
    report = run_quick("benchmarks.hybrid", "--family", "gpt")
    rows = family_rows(report, "gpt")
    for cell, layout in HYBRID_CELLS.items():
        found = [r for r in rows if r["cell"] == cell]
        assert len(found) == 1, (cell, found)
        assert_cell(found[0], layout)

    sweep = report["bubble_sweep"]
    assert {(r["schedule"], r["stages"], r["micro_batches"]) for r in sweep} == {
        ("1f1b", p, m) for p in (2, 4) for m in (1, 2, 4, 8)
    } | {("interleaved_1f1b", 2, m) for m in (2, 4, 8)}  # 4 blocks: 2 chunks of 1 per rank
    for r in sweep:
        p, m = r["stages"], r["micro_batches"]
        v = 2 if r["schedule"] == "interleaved_1f1b" else 1
        assert r["error"] is None and r["ours_ms"] > 0, r
        assert 0.0 <= r["measured_fraction_mean"] <= 1.0, r
        assert r["theoretical_fraction"] == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-3)
        assert r["measured_idle_over_compute_mean"] >= 0.0, r


@pytest.mark.slow
def test_quick_hybrid_benchmark_reports_the_llama_3d_cell() -> None:
    """HF ``LlamaForCausalLM`` (grouped-query attention, rotary tables, its own plan): 2
    stages, 2 tensor ranks, the rest data-parallel, against torch's pipelining + DTensor. The 3D
    cell alone: it holds the Llama's pipeline cut and tensor plan on both sides, and the GPT's
    test above runs every kind of cell (the four Llama cells took 150 s of CI)."""
    pytest.importorskip("transformers")
    report = run_quick("benchmarks.hybrid", "--family", "llama", "--cells", "3d")
    assert report["bubble_sweep"] == []  # the sweep is the GPT's
    info = report["llama_models"]["tiny"]
    assert info["split_points"] == ["model.layers.2"], info
    assert info["config"]["num_key_value_heads"] < info["config"]["num_attention_heads"]
    rows = family_rows(report, "llama")
    assert {r["cell"] for r in rows} == {"single", "3d"}
    for cell, layout in LLAMA_CELLS.items():
        found = [r for r in rows if r["cell"] == cell]
        assert len(found) == 1, (cell, found)
        assert_cell(found[0], layout)
