"""Smoke test of ``python -m benchmarks.scale --quick``: every strategy runs against its torch
twin, trains the same losses, and the JSON carries the step times, where ours spends them,
the CPU a step of both sides, every trainer's and server's peak memory against the
formula, and a rank's compute alone.

Runs the benchmark as a user would, in its own process group (stopped by its id on a
timeout)."""

from __future__ import annotations

import argparse

import pytest
from quick_benchmarks import run_quick

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")


@pytest.mark.slow
def test_quick_scale_benchmark_reports_every_cell() -> None:
    report = run_quick("benchmarks.scale")
    assert report["machine"]["cores"] >= 1 and "loadavg_at_start" in report["machine"]
    over = report["process_overhead"]
    # a rank's compute alone, once a model: what the cost model predicts the cells from
    ref = report["compute_reference"]["quick"]
    assert min(ref[k] for k in ("forward_ms", "backward_ms", "optimizer_ms", "cpu_ms")) > 0, ref
    assert ref["step_ms"] >= ref["forward_ms"] + ref["backward_ms"], ref
    assert ref["minor_faults_k"] >= 0, ref
    assert over["trainer"] > 50 * 2**20 and over["server"] > 20 * 2**20, over
    rows = {r["strategy"]: r for r in report["results"]}
    assert set(rows) == set(STRATEGIES), rows.keys()
    for strategy, row in rows.items():
        assert not row.get("error") and not row.get("skipped"), row
        assert row["world_size"] == 2
        assert row["ours_ms"] > 0 and row["torch_ms"] > 0
        assert row["ratio"] == pytest.approx(row["ours_ms"] / row["torch_ms"], rel=1e-2)
        # the same model, batches and AdamW on both sides: float32 losses stay together
        assert row["loss_max_rel_diff"] < 1e-4, row["loss_max_rel_diff"]
        ours = row["ours_breakdown_ms"]
        assert ours["compute"] > 0 and ours["blocked_total"] >= 0, ours
        # the garbage collector's seconds a step, both sides (0 when nothing was collected)
        assert ours["gc"] >= 0 and row["torch_breakdown_ms"]["gc"] >= 0, row
        waits = {"ddp": "blocked/all_reduce", "zero1": "blocked/push"}
        waits |= {"zero2": "blocked/step", "fsdp": "blocked/gather"}
        assert waits[strategy] in ours, ours
        mem = row["ours_memory"]
        assert len(mem["trainer_peak_rss_mb"]) == 2
        assert min(mem["trainer_peak_rss_mb"]) >= over["trainer"] / 2**20
        if strategy != "ddp":  # DDP keeps nothing on the servers
            assert len(mem["server_peak_rss_mb"]) == 2 and ours["server_step"] >= 0
            assert 0.9 < mem["server_ratio_to_formula"] < 2.0, mem
            # sampled while the ranks ran: the servers' own memory and the segments they map
            own, shmem = mem["server_peak_own_mb"], mem["server_peak_shmem_mb"]
            assert len(own) == len(shmem) == 2 and min(own) > 0, mem
            assert all(o <= p for o, p in zip(own, mem["server_peak_rss_mb"], strict=True)), mem
        assert len(row["torch_memory"]["trainer_peak_rss_mb"]) == 2
        # CPU a step: both sides' ranks, ours' servers (read from /proc by rank 0)
        assert row["torch_cpu_per_step_s"]["trainers"] > 0, row
        # a rank's CPU by kind of thread, and its training thread's by phase, both sides
        threads = {s: row[f"{s}_rank_threads_cpu_s"] for s in ("ours", "torch")}
        assert all("main" in t and min(t.values()) >= 0 for t in threads.values()), threads
        assert "gloo_tcp_loop" in threads["torch"] and "session-receiver" in threads["ours"]
        for side in ("ours", "torch"):
            got = row[f"{side}_breakdown_ms"]
            assert got["main_cpu/backward"] > 0 and got["main_cpu/forward"] > 0, got
            assert got["minor_faults_k"] >= 0, got
        # the servers' by kind of thread (the kernel's names: server/runtime/thread_names.py)
        servers = row["ours_server_threads_cpu_s"]
        assert "session" in servers and min(servers.values()) >= 0, servers
        cpu = row["ours_cpu_per_step_s"]
        assert (
            cpu["trainers"] > 0
            and cpu["servers"] >= 0
            and "servers" not in row["torch_cpu_per_step_s"]
        ), row


def test_a_cell_that_cannot_fit_is_skipped_before_either_side_runs(monkeypatch) -> None:
    """torch's side fits and ours does not: the cell is skipped before torch's runs (one
    side alone compares nothing, and at 1B it took minutes), whichever side comes first."""
    from benchmarks import scale

    gib = scale.GiB
    need = {"torch": 1 * gib, "ours": 3 * gib}
    monkeypatch.setattr(scale, "estimate", lambda m, st, side, *rest: need[side])
    monkeypatch.setattr(scale, "meminfo", lambda key: 2 * gib)
    ran = []
    monkeypatch.setattr(scale, "run_side", lambda side, *rest: ran.append(side))
    for first in (0, 1):  # torch first, then ours first
        a = argparse.Namespace(sides=["torch", "ours"], order_index=first, margin_gib=0.0,
                               wait_quiet=0.0, warmup_for={"quick": 1})  # fmt: skip
        row = scale.run_cell("quick", "fsdp", 2, a, {"trainer": 0, "server": 0})
        assert row["skipped"].startswith("ours: needs about 3.0 GiB"), row
        assert ran == [] and a.order_index == first


@pytest.mark.slow
def test_quick_scale_with_bucket_views_and_the_compute_beside() -> None:
    """``--bucket-views``: both sides' DDP keep their gradients as views of their buckets
    (``gradient_as_bucket_view``); the cell still trains torch's losses. ``--compute-beside``
    (in the same run: each benchmark run starts its ranks and servers anew, the most of its
    time): a cell measures the compute alone between its two sides, and the cost model's
    check predicts the cell from it rather than from the run's."""
    from benchmarks import _cost_steps

    report = run_quick(
        "benchmarks.scale",
        "--strategies",
        "ddp",
        "--no-compute",
        "--bucket-views",
        "--compute-beside",
    )
    assert report["gradient_as_bucket_view"] is True
    assert "compute_reference" not in report
    (row,) = report["results"]
    assert not row.get("error") and not row.get("skipped"), row
    assert row["loss_max_rel_diff"] < 1e-4 and row["ours_ms"] > 0 and row["torch_ms"] > 0, row
    beside = row["compute_beside"]
    assert min(beside[k] for k in ("forward_ms", "backward_ms", "optimizer_ms")) > 0, beside
    costs = {side: {"cpu_s_per_message": 1e-4, "cpu_s_per_byte": 1e-9} for side in ("ours", "gloo")}
    checked = _cost_steps.check_steps(report, costs)
    assert checked["not_checked"] == [] and [r["compute"] for r in checked["rows"]] == ["beside"]
