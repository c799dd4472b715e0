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
from benchmarks._cpu import Load, wait_quiet
from benchmarks._netns import Namespaces, counters_between, unavailable
from benchmarks._ns_training import gradient_mib, section_training
from benchmarks._processes import Child, child_env, expect_all, stop_all
from benchmarks._transport import (
    child,
    gbps,
    link_gbit,
    log,
    median_ms,
    start_servers,
)


def rank_argv(a: argparse.Namespace) -> list[str]:
    argv = ["--sizes", ",".join(repr(s) for s in a.sizes), "--warmup", str(a.warmup)]
    argv += ["--chunk-mib", f"{a.chunk_mib:g}", "--in-flight", str(a.in_flight)]
    if a.reps:
        argv += ["--reps", str(a.reps)]
    if a.quick:
        argv.append("--quick")
    return argv


def result_timeout(a: argparse.Namespace, w: int) -> float:
    return 120.0 + 6.0 * w * sum(reps_for(s, a) * max(1.0, s / 8) for s in a.sizes)


VARIANTS = {
    "ours": "each rank process hosts its own ShardServer (calls to it go in-process)",
    "ours_sep": "W separate `paramshard serve` processes on this host: payloads through shared"
    " segments (the deployed shape of one host)",
    "ours_sep_inband": "the same servers and ranks with PARAMSHARD_SHM=0: payloads in-band",
    "gloo": "torch.distributed on gloo, ranks on this host (loopback TCP)",
    "ours_ns": "one network namespace per rank (a host on a veth bridge, benchmarks/_netns.py),"
    " each with its rank and a separate server process; PARAMSHARD_SHM=0, so every payload"
    " crosses TCP (the veths, or loopback to the rank's own server)",
    "ours_ns_shm": "the same namespaces, ranks and servers, each rank reaching its own server"
    " through shared memory, as a host is deployed (the other hosts' servers in-band: the"
    " rank finds it shares no memory with them)",
    "gloo_ns": "gloo ranks in the same namespaces (GLOO_SOCKET_IFNAME=eth0)",
}
REFERENCE = {
    "ours": "gloo",
    "ours_sep": "gloo",
    "ours_sep_inband": "gloo",
    "ours_ns": "gloo_ns",
    "ours_ns_shm": "gloo_ns",
}
RATIO_KEY = {  # the row's key of each variant's ratio to its gloo
    "ours": "ratio_vs_gloo",
    "ours_sep": "sep_ratio_vs_gloo",
    "ours_sep_inband": "sep_inband_ratio_vs_gloo",
    "ours_ns": "ns_ratio_vs_gloo",
    "ours_ns_shm": "ns_shm_ratio_vs_gloo",
}


HOST_VARIANTS = ("ours", "ours_sep", "ours_sep_inband", "gloo")
NS_VARIANTS = ("ours_ns", "ours_ns_shm", "gloo_ns")


def variants(a: argparse.Namespace, lab: Any) -> list[str]:
    out = ["ours"]
    if not a.no_separate:
        out += ["ours_sep"] + ([] if a.no_inband else ["ours_sep_inband"])
    if not a.no_gloo:
        out.append("gloo")
    if lab is not None:
        out += ["ours_ns"] + ([] if a.no_ns_shm else ["ours_ns_shm"])
        out += [] if a.no_gloo else ["gloo_ns"]
    return out


def run_ours(w: int, a: argparse.Namespace, variant: str, lab: Any) -> list[dict[str, Any]]:
    """One run of ``variant`` (``VARIANTS``) at world size ``w``; ``lab``: the namespaces."""
    kids: list[Child] = []

    across = variant in ("ours_ns", "ours_ns_shm")

    def where(r: int) -> list[str]:
        return lab.exec_prefix(lab.hosts[r]) if across else []

    try:
        if across:
            servers = [
                child(f"nsserver{i}", ["_server", "--bind", lab.ip[h]], child_env(True),
                      a.lifetime, where(i))
                for i, h in enumerate(lab.hosts[:w])
            ]  # fmt: skip
            addrs = expect_all(servers, "ADDR", 60, watch=servers)
            kids += servers
        elif variant != "ours":
            servers, addrs = start_servers(w, False, a, "sep")
            kids += servers
        env = child_env(True)
        if variant in ("ours_sep_inband", "ours_ns"):
            env["PARAMSHARD_SHM"] = "0"
        run_id = f"bench{os.getpid()}w{w}{variant}"
        ranks = [
            child(
                f"{variant}rank{r}",
                ["_rank", "--rank", str(r), "--world", str(w), "--run-id", run_id]
                + (["--host-server"] if variant == "ours" else [])
                + rank_argv(a),
                env,
                a.lifetime,
                where(r),
            )
            for r in range(w)
        ]
        kids += ranks
        if variant == "ours":
            addrs = expect_all(ranks, "ADDR", 60, watch=ranks)
        server_pids = [k.proc.pid for k in servers] if variant != "ours" else []
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


def run_gloo(w: int, a: argparse.Namespace, lab: Any = None) -> list[dict[str, Any]]:
    """gloo ranks on this host, or (``lab``) one in each namespace."""
    fd, init_file = tempfile.mkstemp(prefix="collectives_gloo_")
    os.close(fd)
    os.unlink(init_file)  # the FileStore creates it
    env = child_env(a.gloo_env == "tuned")
    if lab is not None:
        env["GLOO_SOCKET_IFNAME"] = "eth0"
    kids = [
        child(
            f"gloo{'ns' if lab else ''}rank{r}",
            ["_gloo", "--rank", str(r), "--world", str(w), "--init-file", init_file] + rank_argv(a),
            env,
            a.lifetime,
            lab.exec_prefix(lab.hosts[r]) if lab is not None else [],
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
    """Every variant (``VARIANTS``) of every op and size, each world size in one run; the
    cross-namespace ones once per link rate of ``--rates`` (``Namespaces.shape``), their rows
    in ``doc["netns"]["results"]`` with the rate."""
    if not a.no_netns:
        why = unavailable()
        doc["netns"] = {
            "lab": why or "one namespace per rank on a veth bridge (benchmarks/_netns.py)"
        }
        if why is None:
            with Namespaces([f"h{r}" for r in range(max(a.world_sizes))]) as lab:
                _collectives(doc, a, lab)
            return
    _collectives(doc, a, None)


def _collectives(doc: dict[str, Any], a: argparse.Namespace, lab: Any) -> None:
    every = variants(a, lab)
    doc["phases"] = []
    if "collectives" in a.parts:
        doc["variants"] = {v: VARIANTS[v] for v in every}
        host = [v for v in every if v in HOST_VARIANTS]
        doc["results"] = _measure(doc, a, lab, host, None)
    if lab is None:
        return
    ns = [v for v in every if v in NS_VARIANTS]
    doc["netns"].update(shaping=[], results=[], training=[])
    if "training" in a.parts:
        doc["netns"]["training_model"] = {
            "model": a.train_model,
            "gradient_mib": gradient_mib(a.train_model),
            "how": "benchmarks/_ns_training.py",
        }
    for rate in a.rates:
        applied = lab.shape(rate)
        doc["netns"]["shaping"].append(applied)
        try:
            # the link's real rate, before and after the cells (benchmarks/cost_model.py's
            # check uses it: a shaped lab on busy cores runs below its nominal rate)
            applied["raw_tcp_gbit"] = [link_gbit(a, lab)]
            log(f"links: {applied}")
            if "collectives" in a.parts:
                doc["netns"]["results"] += _measure(doc, a, lab, ns, rate)
            if "training" in a.parts:
                doc["netns"]["training"] += section_training(a, lab, rate)
            applied["raw_tcp_gbit"].append(link_gbit(a, lab))
        finally:
            lab.shape(None)


def _measure(
    doc: dict[str, Any], a: argparse.Namespace, lab: Any, order: list[str], rate: float | None
) -> list[dict[str, Any]]:
    """The rows of ``order``'s variants at every world size (links at ``rate`` Gbit/s)."""
    rows: list[dict[str, Any]] = []
    for w in a.world_sizes:
        got: dict[str, list[list[dict[str, Any]]]] = {}
        for rnd in range(a.rounds):
            # alternate the order, so drift on a busy machine does not favour one variant
            for v in order if rnd % 2 == 0 else order[::-1]:
                busy_before = wait_quiet(a.wait_quiet, 0.2) if a.wait_quiet > 0 else None
                log(f"W={w}: {v} (round {rnd + 1}/{a.rounds}, links {rate or 'unlimited'})")
                t0 = time.monotonic()
                loadavg = [round(x, 2) for x in os.getloadavg()]
                links = lab.counters() if lab is not None and v in NS_VARIANTS else None
                with Load() as load:
                    if v.startswith("gloo"):
                        res = run_gloo(w, a, lab if v == "gloo_ns" else None)
                    else:
                        res = run_ours(w, a, v, lab)
                got.setdefault(v, []).append(res)
                doc["phases"].append(
                    {
                        "world_size": w,
                        "variant": v,
                        "rate_gbit": rate,
                        "round": rnd,
                        "seconds": round(time.monotonic() - t0, 1),
                        "foreign_cpu_frac": load.foreign,
                        "steal_frac": load.steal,
                        "busy_before": busy_before,
                        "loadavg_at_start": loadavg,
                    }
                )
                if links is not None:  # drops and resends during every op and size of v
                    doc["phases"][-1]["links"] = counters_between(links, lab.counters())
                if not v.startswith("gloo"):  # one unary call's round trip, each rank's
                    rtt = [r["status_rtt_ms"] for r in res]
                    doc["phases"][-1]["status_rtt_ms"] = rtt
                    log(f"  one unary call (Status), ms a rank: {rtt}")
        if "gloo" in got:
            doc.setdefault("gloo_reduce_scatter_impl", got["gloo"][0][0]["reduce_scatter_impl"])
        for op in OPS:
            for mib in a.sizes:
                row = _row(op, w, mib, {v: summarise(got[v], op, mib) for v in got})
                if rate is not None or order[0] in NS_VARIANTS:
                    row["rate_gbit"] = rate
                rows.append(row)
    return rows


def _row(op: str, w: int, mib: float, s: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One op, world size and size: every variant's median, GB/s and ratio to its gloo."""
    nbytes = int(mib * MiB)
    row: dict[str, Any] = {"op": op, "world_size": w, "mib": mib}
    for v, sv in s.items():
        row[f"{v}_ms"] = sv["ms"]
        row[f"{v}_gbps"] = gbps(nbytes, sv["ms"])
        row[f"{v}_ms_min_max"] = sv["ms_min_max"]
        row[f"{v}_cpu_ms_per_rank"] = sv["cpu_ms_per_rank"]
        row[f"{v}_verified"] = sv["ok"]
    for v, ref in REFERENCE.items():
        if v in s and ref in s:
            row[RATIO_KEY[v]] = round(s[v]["ms"] / s[ref]["ms"], 3)
    if "ours_sep" in s:
        row["faster_placement"] = (
            "in-process" if row["ours_ms"] <= row["ours_sep_ms"] else "separate"
        )
    if "gloo" in s and "ours" in s:
        row["cpu_ratio_vs_gloo"] = round(
            s["ours"]["cpu_ms_per_rank"] / max(1e-9, s["gloo"]["cpu_ms_per_rank"]), 3
        )
    row["reps"] = next(iter(s.values()))["reps"]
    log(
        f"  {op:<14} W={w} {mib:>4g} MiB"
        + "".join(f"  {v} {row[f'{v}_ms']:.1f} ms" for v in s)
        + "".join(f"  {RATIO_KEY[v]} {row[RATIO_KEY[v]]}" for v in REFERENCE if RATIO_KEY[v] in row)
    )
    return row
