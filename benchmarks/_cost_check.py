"""The cost model's check against the collectives lab (benchmarks/cost_model.py, step 2):
every cross-namespace cell of one or more ``benchmarks.collectives`` runs that the fit did not
see (W = 4, and every link rate), its CPU per host predicted from the counts
(``benchmarks/_cost_counts.py``) and its time as ``max(work, bytes over a link / its rate +
the per-message part)`` (``lab_time``; the work: the lab's time a message and a byte at W =
2, and at W = 4, four hosts on two cores, twice the hosts' CPU), the rate being what one raw
TCP stream moved across the shaped link in the same run, against what was measured. The
held-out cells within 20% are counted by side, W and rate, by run, and, where a run recorded
it, by the steal of the cell's phase (``phases[].steal_frac``: on a virtual machine the
hypervisor's share, which rises with the host's load and with a benchmark's own wake-ups,
benchmarks/_cpu.py ``Load``): a phase that lost 10% or more of the CPUs to it is not the
machine the fit measured. ``spread`` counts how far each side's own runs scatter: what no
model of one number a cell can do better than.

Also here: what the check and the fit read from a run's JSON (``chunk_of``, ``netns_rows``,
``tensor_bytes``).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks import _cost_counts as cc
from benchmarks._collective_ranks import numel

MiB = 2**20
LAB_CORES = 2  # the machine the lab runs on: every host's processes share its cores
QUIET_STEAL = 0.1  # a phase that lost less of the CPUs to the hypervisor is counted as quiet
WITHIN = 0.2  # the bound on the model's error
SPREAD_RUNS = 3  # a cell measured in fewer runs says nothing of how its runs scatter


def chunk_of(doc: dict[str, Any]) -> int:
    """The chunk the run's clients sent across the namespaces: the one it names, or the
    clients' default there (``client.chunk_mib_netns``), or ``cc.CHUNK_BEFORE`` for JSON that
    says neither."""
    client = doc.get("client") or {}
    mib = client.get("chunk_mib") or client.get("chunk_mib_netns")
    return int(mib * MiB) if mib else cc.CHUNK_BEFORE


def netns_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = doc.get("netns", {}).get("results") or []
    if not rows:
        raise SystemExit("the collectives JSON has no cross-namespace rows (run it as root)")
    return rows


def tensor_bytes(r: dict[str, Any]) -> int:
    """The bytes of the tensor a row's op ran on (``numel``: "4B" is one float32 a rank)."""
    return 4 * numel(r["mib"], r["world_size"])


def is_fitted(r: dict[str, Any]) -> bool:
    """A cross-namespace row the fit uses: W = 2 with unlimited links (two hosts, one core
    each: the machine's two)."""
    return r.get("rate_gbit") is None and r["world_size"] == 2


def lab_time(
    side: str, c: dict[str, float], op: str, nbytes: float, w: int, rate: Any,
    chunk: int | None = None, fused: bool = True,
) -> float:  # fmt: skip
    """Predicted wall seconds of one op in the lab: each of W hosts gets LAB_CORES / W cores
    (at most one), links moving ``rate`` Gbit/s (None: unlimited, their cost is the CPU's).
    The longer of two floors: the work, and the messages one after another (their lab time,
    waits included, and the link's). The work: with a core a host, the lab's time a message
    and a byte (the fit's host waits for its peer at times); with more hosts than cores, the
    hosts' CPU over the cores, as the machine is busy throughout (a host's waits are others'
    turns: in quiet runs ours' large W = 4 cells took a median 2.1x their CPU a rank and
    gloo's 2.1-2.3x, against 1.1x and 1.3-1.4x at W = 2; docs/scaling.md)."""
    return counts_time(c, cc.op_counts(side, op, nbytes, w, chunk, fused), w, rate)


def counts_time(
    c: dict[str, float], counts: tuple[float, float, float], w: int, rate: Any
) -> float:
    """``lab_time`` of an op whose (messages, bytes handled, bytes on the wire) a host are
    ``counts`` (``_cost_counts.op_counts``)."""
    msgs, handled, wire = counts
    slow = max(1.0, w / LAB_CORES)  # hosts sharing the machine's cores
    if slow > 1:
        work = cc.cpu_s(c, msgs, handled) * slow
    else:
        work = c["s_per_message"] * msgs + c["s_per_byte"] * handled
    link = wire * 8 / (rate * 1e9) if rate else 0.0
    return max(work, link + c["s_per_message"] * msgs * slow)


def link_rates(doc: dict[str, Any]) -> dict[float, float]:
    """Nominal rate -> what a raw TCP stream moved across the shaped link in the same run
    (``benchmarks.collectives`` measures it before and after each rate's cells; the mean).
    A rate without that measurement (older JSON) stands for itself."""
    out = {}
    for s in doc.get("netns", {}).get("shaping") or []:
        got = s.get("raw_tcp_gbit") or []
        if s.get("rate_gbit") and got:
            out[s["rate_gbit"]] = sum(got) / len(got)
    return out


def phase_steal(doc: dict[str, Any]) -> dict[tuple[str, int, Any], float]:
    """(variant, W, nominal rate) -> the steal its phase saw (``phases[].steal_frac``; the
    first round's where there were several); empty for a run from before it was recorded."""
    out: dict[tuple[str, int, Any], float] = {}
    for p in doc.get("phases") or []:
        if p.get("steal_frac") is not None:
            out.setdefault((p["variant"], p["world_size"], p.get("rate_gbit")), p["steal_frac"])
    return out


def _tally(rows: list[dict[str, Any]], group: Any) -> dict[str, str]:
    """The held-out cells within 20% (time, CPU) by ``group(row)``, a name or None (left out),
    in the order the groups first come."""
    groups: dict[str, list[int]] = {}
    for r in rows:
        key = None if r["fitted"] else group(r)
        if key is None:
            continue
        g = groups.setdefault(key, [0, 0, 0])
        g[0] += abs(r["error"]) <= WITHIN
        g[1] += abs(r["cpu_error"]) <= WITHIN
        g[2] += 1
    return {k: f"time {a}, CPU {b} of {n}" for k, (a, b, n) in groups.items()}


def spread(rows: list[dict[str, Any]], least: int = SPREAD_RUNS) -> dict[str, str]:
    """How far a side's own measurements scatter between runs: every cell measured in
    ``least`` runs or more, each run's time (and CPU) within 20% of the cell's median over the
    runs, counted by side and W. No model that predicts one number a cell can do better
    against these runs, so this bounds what the check can reach on this machine."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault(
            (r["side"], r["op"], r["world_size"], r["bytes"], r["rate_gbit"]), []
        ).append(r)
    groups: dict[str, list[int]] = {}
    for (side, _, w, _, _), got in cells.items():
        if len(got) < least:
            continue
        g = groups.setdefault(f"{side} W={w}", [0, 0, 0])
        for key, i in (("measured_ms", 0), ("measured_cpu_ms", 1)):
            mid = statistics.median(r[key] for r in got)
            g[i] += sum(abs(r[key] / mid - 1) <= WITHIN for r in got)
        g[2] += len(got)
    return {k: f"time {a}, CPU {b} of {n}" for k, (a, b, n) in sorted(groups.items())}


def _steal_group(r: dict[str, Any]) -> str | None:
    """A row's side and whether its phase was quiet (``QUIET_STEAL``); None unrecorded."""
    if r.get("phase_steal") is None:
        return None
    quiet = "under" if r["phase_steal"] < QUIET_STEAL else "at or over"
    return f"{r['side']}, steal {quiet} {QUIET_STEAL:.0%}"


def _run_rows(
    doc: dict[str, Any], run: int, costs: dict[str, dict[str, float]], whole: bool
) -> list:
    """One run's rows, both sides, each cell's time predicted with the link's measured rate
    (``link_rates``) and carrying its phase's steal where the run recorded it; ``whole``: a
    run the fit did not see, every cell held out."""
    rows = []
    measured, chunk, steal = link_rates(doc), chunk_of(doc), phase_steal(doc)
    fused = cc.fused_reads(doc.get("client") or {})
    for r in netns_rows(doc):
        link = measured.get(r.get("rate_gbit"), r.get("rate_gbit"))
        for side in ("ours", "gloo"):
            variant = f"{side}_ns"  # its phase's name; its rows' keys start so
            key = f"{variant}_ms"
            if key not in r:
                continue
            c, nbytes, w = costs[side], tensor_bytes(r), r["world_size"]
            counts = cc.op_counts(side, r["op"], nbytes, w, chunk, fused)
            pred = counts_time(c, counts, w, link) * 1e3
            cpu = cc.cpu_s(c, *counts[:2]) * 1e3
            rows.append({"run": run, "side": side, "op": r["op"], "world_size": w,
                         "bytes": round(nbytes), "rate_gbit": r.get("rate_gbit"),
                         "link_gbit": link,
                         "measured_ms": r[key], "predicted_ms": round(pred, 3),
                         "error": round(pred / r[key] - 1, 3), "fitted": not whole and is_fitted(r),
                         "measured_cpu_ms": r[f"{variant}_cpu_ms_per_rank"],
                         "predicted_cpu_ms": round(cpu, 3),
                         "cpu_error": round(
                             cpu / max(r[f"{variant}_cpu_ms_per_rank"], 1e-6) - 1, 3),
                         "phase_steal": steal.get((variant, w, r.get("rate_gbit")))})  # fmt: skip
    return rows


def check(
    docs: list[dict[str, Any]], costs: dict[str, dict[str, float]], whole: int = 0
) -> dict[str, Any]:
    """Every cell of every run in ``docs`` against ``costs``, the held-out ones counted (runs
    numbered from 1 in the order given); the last ``whole`` runs are ones the fit did not see,
    whose every cell is held out, its W = 2 unlimited ones too."""
    fitted_runs = len(docs) - whole
    rows = [r for i, doc in enumerate(docs) for r in _run_rows(doc, i + 1, costs, i >= fitted_runs)]
    held = [r for r in rows if not r["fitted"]]

    def run_group(r: dict[str, Any]) -> str:
        unseen = " (not fitted: every cell)" if r["run"] > fitted_runs else ""
        return f"{r['side']}, run {r['run']}{unseen}"

    by_group = _tally(
        rows, lambda r: f"{r['side']} W={r['world_size']} {r['rate_gbit'] or 'unlimited'}"
    )
    steals = [phase_steal(doc) for doc in docs[:fitted_runs]]
    return {
        "rows": rows,
        "held_out_within_20pct": sum(abs(r["error"]) <= WITHIN for r in held),
        "held_out_cells": len(held),
        "by_group": by_group,
        "by_run": _tally(rows, run_group) if len(docs) > 1 else {},
        "spread": spread(rows),
        "fit_phase_steal": {
            s: [st.get((f"{s}_ns", 2, None)) for st in steals] for s in ("ours", "gloo")
        },
        "by_steal": dict(sorted(_tally(rows, _steal_group).items())),
        "link_gbit_measured": [link_rates(doc) for doc in docs],
    }
