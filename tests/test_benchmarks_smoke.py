"""Smoke tests of ``python -m benchmarks.strategies --quick`` and ``python -m benchmarks.hybrid
--quick`` (the example GPT and HF Llama): they run, and their JSON is complete.

Runs the benchmark as a user would, in its own process group, so that on a timeout the whole
group (benchmark, trainers, servers, gloo ranks: every process it started) is stopped by id.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from numerics import TWIN_FACTOR, TWIN_FLOOR

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # --quick takes < 2 (hybrid, each family: < 3) minutes on an idle 2-core machine
OURS = ("ddp", "zero1", "zero2", "fsdp")
HYBRID_CELLS = {"pp_gpipe": (4, 1, 1), "pp_1f1b": (4, 1, 1), "tp": (1, 4, 1), "3d": (2, 2, 1)}
LLAMA_CELLS = {"3d": (2, 2, 1)}


def run_quick(module: str = "benchmarks.strategies", *options: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--quick", *options],
        cwd=ROOT,
        env=env,
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


@pytest.mark.slow
def test_quick_benchmark_reports_every_strategy() -> None:
    report = run_quick()
    rows = report["results"]
    assert {r["model"] for r in rows} == {"tiny"}
    assert {r["world_size"] for r in rows} == {2}

    single = [r for r in rows if r["strategy"] == "single"]
    assert len(single) == 1 and single[0]["torch_ms"] > 0, single

    psi = report["models"]["tiny"]["n_params"]
    assert 0.8e6 < psi < 0.95e6  # the benchmarks' tiny GPT (867,072)

    for strategy in OURS:
        found = [r for r in rows if r["strategy"] == strategy]
        assert len(found) == 1, (strategy, found)
        row = found[0]
        assert row["error"] is None, row
        assert row["ours_ms"] > 0 and row["torch_ms"] > 0, row
        assert row["ratio"] == pytest.approx(row["ours_ms"] / row["torch_ms"], rel=0.02)
        # the benchmark trains correctly: its float32 losses are no further from single-process
        # torch than torch's own twin's in the same run (tests/numerics.py: the measured bound)
        assert_like_torch(row)

        memory = row["memory"]
        assert [m["rank"] for m in memory] == [0, 1]
        for m in memory:
            assert m["trainer"]["param_bytes"] > 0, m
            assert m["total_bytes"] > 0 and m["formula_bytes"] > 0, m
            assert m["ratio_to_formula"] > 0, m
            assert m["peak_rss_mb"] > 0, m
            server_state = sum(
                m["server"][k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")
            )
            if strategy == "ddp":
                assert m["trainer"]["optimizer_bytes"] > 0, m  # DDP steps its own AdamW
            else:
                # ZeRO / FSDP: master params + grad accumulator + Adam moments on the server
                assert server_state > 0 and m["trainer"]["optimizer_bytes"] == 0, m
        assert row["torch_memory"] and all(t["param_bytes"] > 0 for t in row["torch_memory"])


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


def test_quick_p2p_benchmark_reports_every_side() -> None:
    """``benchmarks.p2p --quick``: both ranks of every side exchanged the tensors their peer
    sent, and the report gives each side's medians and ours' CPU by thread."""
    report = run_quick("benchmarks.p2p")
    rows = report["rows"]
    assert {r["side"] for r in rows} == {"ours", "ours-unary", "gloo"}
    for r in rows:
        assert "error" not in r and r["received_ok"] is True, r
        assert r["roundtrip_ms"] > 0 and r["cpu_per_message_ms"] > 0, r
        if r["side"] != "gloo":  # 10 ms clock ticks: 200 round trips take several
            assert r["cpu_by_thread_ms"] and min(r["cpu_by_thread_ms"].values()) > 0, r
    (summary,) = report["summary"]
    assert set(summary["medians"]) == {"ours", "ours-unary", "gloo"}
    assert summary["ours_over_gloo"]["roundtrip_ms"] > 0
