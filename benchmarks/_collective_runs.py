"""benchmarks/collectives.py's collectives section: each world size and size through ours (servers
in the ranks' processes, or separate) and through torch gloo, in one run, summarised."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

from benchmarks._collective_ranks import (
    OPS,
    MiB,
    reps_for,
)
from benchmarks._processes import (
    Child,
    Load,
    child_env,
    expect_all,
    stop_all,
    wait_quiet,
)
from benchmarks._transport import (
    child,
    gbps,
    log,
    median_ms,
    start_servers,
)


def rank_argv(a: argparse.Namespace) -> list[str]:
    argv = ["--sizes", ",".join(f"{s:g}" for s in a.sizes), "--warmup", str(a.warmup)]
    argv += ["--chunk-mib", f"{a.chunk_mib:g}", "--in-flight", str(a.in_flight)]
    if a.reps:
        argv += ["--reps", str(a.reps)]
    if a.quick:
        argv.append("--quick")
    return argv


def result_timeout(a: argparse.Namespace, w: int) -> float:
    return 120.0 + 6.0 * w * sum(reps_for(s, a) * max(1.0, s / 8) for s in a.sizes)


def run_ours(w: int, a: argparse.Namespace, separate: bool) -> list[dict[str, Any]]:
    kids: list[Child] = []
    try:
        if separate:
            servers, addrs = start_servers(w, False, a, "sep")
            kids += servers
        env = child_env(True)
        run_id = f"bench{os.getpid()}w{w}{'s' if separate else 'i'}"
        ranks = [
            child(
                f"{'sep' if separate else 'ours'}rank{r}",
                ["_rank", "--rank", str(r), "--world", str(w), "--run-id", run_id]
                + ([] if separate else ["--host-server"])
                + rank_argv(a),
                env,
                a.lifetime,
            )
            for r in range(w)
        ]
        kids += ranks
        if not separate:
            addrs = expect_all(ranks, "ADDR", 60, watch=ranks)
        server_pids = [k.proc.pid for k in servers] if separate else []
        for k in ranks:
            k.send(json.dumps([addrs, server_pids]))
        timeout = result_timeout(a, w)
        results = [json.loads(x) for x in expect_all(ranks, "RESULT", timeout, watch=kids)]
        for k in ranks:
            k.send("CLOSE")
        expect_all(ranks, "CLOSED", 30, watch=kids)
        return results
    finally:
        stop_all(kids)


def run_gloo(w: int, a: argparse.Namespace) -> list[dict[str, Any]]:
    fd, init_file = tempfile.mkstemp(prefix="collectives_gloo_")
    os.close(fd)
    os.unlink(init_file)  # the FileStore creates it
    env = child_env(a.gloo_env == "tuned")
    kids = [
        child(
            f"gloorank{r}",
            ["_gloo", "--rank", str(r), "--world", str(w), "--init-file", init_file] + rank_argv(a),
            env,
            a.lifetime,
        )
        for r in range(w)
    ]
    try:
        return [json.loads(x) for x in expect_all(kids, "RESULT", result_timeout(a, w), kids)]
    finally:
        stop_all(kids, timeout=30)
        if os.path.exists(init_file):
            os.unlink(init_file)


def summarise(rounds: list[list[dict[str, Any]]], op: str, mib: float) -> dict[str, Any]:
    """Pools the repetitions of every round: a repetition's time is the max over its ranks."""
    worst: list[float] = []
    cpu: list[float] = []
    ok = True
    for results in rounds:
        per_rank = [r[f"{op}/{mib:g}"] for r in results]
        reps = min(len(p["t"]) for p in per_rank)
        worst += [max(p["t"][i] for p in per_rank) for i in range(reps)]
        cpu += [p["cpu_s"] for p in per_rank]
        ok = ok and all(p["ok"] for p in per_rank)
    return {
        "ms": median_ms(worst),
        "ms_min_max": [round(min(worst) * 1e3, 3), round(max(worst) * 1e3, 3)],
        "reps": len(worst),
        "cpu_ms_per_rank": round(statistics.mean(cpu) * 1e3, 2),
        "ok": ok,
    }


def section_collectives(doc: dict[str, Any], a: argparse.Namespace) -> None:
    """ours (in-process servers), ours_sep (server processes) and gloo, every op and size."""
    rows: list[dict[str, Any]] = []
    phases: list[dict[str, Any]] = []
    for w in a.world_sizes:
        got: dict[str, list[list[dict[str, Any]]]] = {}
        variants = (
            ["ours"] + ([] if a.no_separate else ["ours_sep"]) + ([] if a.no_gloo else ["gloo"])
        )
        for rnd in range(a.rounds):
            # alternate the order, so drift on a busy machine does not favour one variant
            for v in variants if rnd % 2 == 0 else variants[::-1]:
                busy_before = wait_quiet(a.wait_quiet, 0.2) if a.wait_quiet > 0 else None
                log(f"W={w}: {v} (round {rnd + 1}/{a.rounds})")
                t0 = time.monotonic()
                with Load() as load:
                    if v == "gloo":
                        res = run_gloo(w, a)
                    else:
                        res = run_ours(w, a, separate=(v == "ours_sep"))
                got.setdefault(v, []).append(res)
                phases.append(
                    {
                        "world_size": w,
                        "variant": v,
                        "round": rnd,
                        "seconds": round(time.monotonic() - t0, 1),
                        "foreign_cpu_frac": load.foreign,
                        "busy_before": busy_before,
                    }
                )
        if "gloo" in got:
            doc.setdefault("gloo_reduce_scatter_impl", got["gloo"][0][0]["reduce_scatter_impl"])
        for op in OPS:
            for mib in a.sizes:
                nbytes = int(mib * MiB)
                row: dict[str, Any] = {"op": op, "world_size": w, "mib": mib}
                s = {v: summarise(got[v], op, mib) for v in got}
                row["ours_ms"] = s["ours"]["ms"]
                row["gloo_ms"] = s["gloo"]["ms"] if "gloo" in s else None
                row["ratio_vs_gloo"] = (
                    round(row["ours_ms"] / row["gloo_ms"], 3) if row["gloo_ms"] else None
                )
                row["ours_gbps"] = gbps(nbytes, row["ours_ms"])
                row["gloo_gbps"] = gbps(nbytes, row["gloo_ms"])
                if "ours_sep" in s:
                    row["ours_sep_ms"] = s["ours_sep"]["ms"]
                    row["ours_sep_gbps"] = gbps(nbytes, row["ours_sep_ms"])
                    row["sep_ratio_vs_gloo"] = (
                        round(row["ours_sep_ms"] / row["gloo_ms"], 3) if row["gloo_ms"] else None
                    )
                    row["faster_placement"] = (
                        "in-process" if row["ours_ms"] <= row["ours_sep_ms"] else "separate"
                    )
                if "gloo" in s:
                    row["cpu_ratio_vs_gloo"] = round(
                        s["ours"]["cpu_ms_per_rank"] / max(1e-9, s["gloo"]["cpu_ms_per_rank"]), 3
                    )
                for v, sv in s.items():
                    row[f"{v}_ms_min_max"] = sv["ms_min_max"]
                    row[f"{v}_cpu_ms_per_rank"] = sv["cpu_ms_per_rank"]
                    row[f"{v}_verified"] = sv["ok"]
                row["reps"] = s["ours"]["reps"]
                rows.append(row)
                log(
                    f"  {op:<14} W={w} {mib:>4g} MiB  ours {row['ours_ms']:9.2f} ms"
                    + (f"  sep {row['ours_sep_ms']:9.2f} ms" if "ours_sep_ms" in row else "")
                    + (
                        f"  gloo {row['gloo_ms']:9.2f} ms  x{row['ratio_vs_gloo']}"
                        if row["gloo_ms"]
                        else ""
                    )
                )
    doc["results"] = rows
    doc["phases"] = phases
