"""Collectives and flat-buffer transport through the shard servers, against torch gloo and raw TCP.

    python -m benchmarks.collectives [--quick] [--sizes 1,16,64] [--world-sizes 2,4]

Measured in one run, on 127.0.0.1 (DESIGN section 7 has the transport facts these compare to):

- **collectives**: all_reduce, all_gather, reduce_scatter for each world size W and tensor size S,
  (a) ours with each rank process hosting its own ShardServer (server threads in-process),
  (b) ours with the W servers as separate processes, (c) torch.distributed on gloo.
  Every rank is its own process, started with subprocess so that ``server.MALLOC_ENV`` is in its
  environment before the interpreter starts; gloo ranks get the same settings (``--gloo-env
  default`` runs them in the plain environment, as torch users usually do). Each repetition:
  barrier, then time the op on every rank; a repetition's time is the max over ranks; we quote
  the median over the repetitions of all rounds, after warm-up. CPU seconds per op and rank are
  reported too: on 2 cores both sides are CPU-bound, and CPU is steadier than wall time.
- **tcp**: one raw TCP stream on loopback moving S=64 MiB from a sender process to a receiver
  process (recv_into a preallocated buffer, 1-byte ack): the ceiling for one connection.
- **push_pull**: one client process pushing a 64 MiB flat gradient buffer to W server processes
  (``push_grads`` with SGD lr=0 step arguments, so each push also completes a step) and pulling
  the parameters back (``pull_params``).
- **codec**: the same push/pull with servers started with ``fast_codec=False`` and a client that
  uses the generated protobuf classes (``ShardStub``, ``PushGradRequest(data=arr.tobytes())``)
  with the same chunking and calls in flight, against ours.

Size convention (as nccl-tests and the torch anchors): S is the all_reduce tensor, the all_gather
OUTPUT (each rank contributes S/W) and the reduce_scatter INPUT (each rank keeps S/W).
GB/s = S bytes / median seconds / 1e9 (algorithm bandwidth, payload bytes only).

Options: ``--parts transport,collectives``, ``--rounds N``, ``--reps N``, ``--no-separate``,
``--no-gloo``, ``--wait-quiet SECONDS`` (wait for other load to stop before each phase).

Prints one JSON document to stdout; progress goes to stderr. Every child process is started by
this script, has a lifetime watchdog and exits when this process dies; all are stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks._collective_ranks import (
    CHUNK_BYTES,
    MAX_IN_FLIGHT,
    OPS,
    MiB,
    gloo_main,
    pushpull_main,
    rank_main,
    reps_for,
    server_main,
    tcp_recv_main,
    tcp_send_main,
)
from benchmarks._processes import (
    Child,
    ChildError,
    Load,
    child_env,
    child_guard,
    expect_all,
    install_cleanup,
    logger,
    proc_cpu_s,
    stop_all,
    wait_quiet,
)

log = logger("collectives")


def median_ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 3)


def gbps(nbytes: int, ms: float | None) -> float | None:
    return None if not ms else round(nbytes / (ms / 1e3) / 1e9, 3)


# =============================================================================== parent: phases
def child(name: str, argv: list[str], env: dict[str, str], lifetime: float) -> Child:
    """A child running one mode of this module."""
    return Child.module(name, "benchmarks.collectives", argv, env, lifetime)


def start_servers(
    w: int, plain: bool, a: argparse.Namespace, tag: str
) -> tuple[list[Child], list[str]]:
    env = child_env(True)
    kids = [
        child(f"{tag}server{i}", ["_server"] + (["--plain"] if plain else []), env, a.lifetime)
        for i in range(w)
    ]
    return kids, expect_all(kids, "ADDR", 60, watch=kids)


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


def phase_tcp(a: argparse.Namespace) -> list[float]:
    """Seconds per transfer of one raw TCP stream (sender and receiver processes)."""
    env = child_env(True)
    recv = child("tcprecv", ["_tcp_recv"], env, a.lifetime)
    kids = [recv]
    try:
        port = recv.expect("PORT", 60)
        reps = 5 if a.quick else 20
        send = child(
            "tcpsend",
            [
                "_tcp_send",
                "--port",
                port,
                "--mib",
                str(a.tcp_mib),
                "--reps",
                str(reps),
                "--warmup",
                "2",
            ],
            env,
            a.lifetime,
        )
        kids.append(send)
        t = json.loads(send.expect("RESULT", 120))["t"]
    finally:
        stop_all(kids)
    return t


def phase_pushpull(w: int, a: argparse.Namespace) -> dict[str, Any]:
    kids: list[Child] = []
    try:
        fast, fast_addrs = start_servers(w, False, a, "pp")
        plain, plain_addrs = start_servers(w, True, a, "pplain")
        kids += fast + plain
        reps = 3 if a.quick else 15
        cpu0 = {c.name: proc_cpu_s(c.proc.pid) for c in fast + plain}
        cl = child(
            "pushpull",
            ["_pushpull", "--mib", str(a.tcp_mib), "--reps", str(reps), "--warmup", "2"]
            + ["--chunk-mib", f"{a.chunk_mib:g}", "--in-flight", str(a.in_flight)],
            child_env(True),
            a.lifetime,
        )
        kids.append(cl)
        cl.send(json.dumps([fast_addrs, plain_addrs]))
        res = json.loads(expect_all([cl], "RESULT", 300, watch=kids)[0])
        iters = reps + 2
        server_cpu = {
            k: sum(proc_cpu_s(c.proc.pid) - cpu0[c.name] for c in group) / iters
            for k, group in (("ours", fast), ("plain", plain))
        }
    finally:
        stop_all(kids)
    nbytes = int(a.tcp_mib * MiB)
    out: dict[str, Any] = {"world_size": w, "servers": w, "mib": a.tcp_mib}
    for k in ("ours", "plain"):
        r = res[k]
        push, pull, setp = median_ms(r["push"]), median_ms(r["pull"]), median_ms(r["set"])
        both = [x + y for x, y in zip(r["push"], r["pull"], strict=True)]
        out[k] = {
            "push_ms": push,
            "pull_ms": pull,
            "push_pull_ms": median_ms(both),
            "set_params_ms": setp,
            "push_gbps": gbps(nbytes, push),
            "pull_gbps": gbps(nbytes, pull),
            "set_params_gbps": gbps(nbytes, setp),
            "push_pull_gbps": gbps(2 * nbytes, median_ms(both)),
            "client_cpu_push_ms": median_ms(r["push_cpu"]),
            "client_cpu_pull_ms": median_ms(r["pull_cpu"]),
            "servers_cpu_ms_per_iteration": round(server_cpu[k] * 1e3, 1),
            "verified": r["ok"],
            "reps": len(r["push"]),
        }
    out["client_malloc_env"] = bool(res["malloc_env"])
    return out


# ======================================================================================== main
def parse_list(text: str, kind: type) -> list[Any]:
    return [kind(x) for x in text.replace(" ", "").split(",") if x]


def machine() -> dict[str, Any]:
    import grpc
    import numpy

    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "affinity_cores": (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        ),
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "grpcio": grpc.__version__,
        "numpy": numpy.__version__,
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        info["cpu"] = names[0] if names else None
    except OSError:
        pass
    try:
        from importlib.metadata import version

        info["torch"] = version("torch")
    except Exception:  # noqa: BLE001
        info["torch"] = None
    return info


def bench_main(a: argparse.Namespace) -> int:
    from server import MALLOC_ENV

    t_start = time.monotonic()
    doc: dict[str, Any] = {"machine": machine()}
    doc["conventions"] = {
        "size": "S = all_reduce tensor = all_gather OUTPUT (each rank sends S/W) = reduce_scatter"
        " INPUT (each rank keeps S/W); mib = S / 2**20, float32",
        "time": "per repetition: barrier, then the op on every rank; the repetition's time is the"
        " max over ranks; *_ms = median over repetitions after warm-up",
        "gbps": "payload bytes of the tensor S / median time / 1e9 (algorithm bandwidth)",
        "ratio_vs_gloo": "ours_ms / gloo_ms (lower is better; 1.0 = as fast as gloo)",
        "cpu": "*_cpu_ms_per_rank: CPU seconds (user+sys, all threads, incl. a hosted server) of"
        " one rank process per op (over the timed loop, less the barriers' CPU measured"
        " alone), mean over ranks; cpu_ratio_vs_gloo = ours / gloo. On a"
        " 2-core machine both sides are CPU-bound, and CPU is less disturbed by other load"
        " than wall time",
        "rounds": "each world size runs every variant --rounds times in alternating order; the"
        " repetitions of all rounds are pooled before the median",
        "ours": f"each rank process hosts its ShardServer (in-process server threads); chunk"
        f" {a.chunk_bytes / MiB:g} MiB, {a.in_flight} calls in flight per rank",
        "ours_sep": "same ranks, servers as W separate processes (ours_sep_cpu_ms_per_rank ="
        " a rank's own CPU + 1/W of all servers' CPU)",
        "malloc_env": MALLOC_ENV,
        "gloo_env": "allocator-tuned (MALLOC_ENV), as ours"
        if a.gloo_env == "tuned"
        else "default environment (as torch users usually run it)",
    }
    log(f"sizes {a.sizes} MiB, world sizes {a.world_sizes}, quick={a.quick}, parts {a.parts}")
    if a.wait_quiet > 0:
        log(f"waiting up to {a.wait_quiet:.0f} s for a quiet machine")
        doc["machine"]["busy_before_start"] = wait_quiet(a.wait_quiet, 0.2)
    if "transport" in a.parts:
        section_transport(doc, a)
    if "collectives" in a.parts:
        section_collectives(doc, a)
    doc["machine"]["loadavg_at_end"] = list(os.getloadavg())
    doc["seconds"] = round(time.monotonic() - t_start, 1)
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")
    sys.stdout.flush()
    log(f"done in {doc['seconds']} s")
    return 0


def section_transport(doc: dict[str, Any], a: argparse.Namespace) -> None:
    """Raw TCP ceiling, push/pull of a flat buffer, and the codec comparison."""
    log(f"raw TCP, one stream, {a.tcp_mib:g} MiB (measured before and after push/pull)")
    with Load() as load:
        tcp_times = phase_tcp(a)
    tcp_ms = median_ms(tcp_times)
    doc["tcp_gbps"] = gbps(int(a.tcp_mib * MiB), tcp_ms)  # provisional, until the second run
    log(f"  tcp {doc['tcp_gbps']} GB/s")
    tcp_foreign = [load.foreign]

    pp_rows = []
    for w in a.world_sizes:
        log(f"push/pull {a.tcp_mib:g} MiB to {w} servers (ours and plain protobuf)")
        with Load() as load:
            row = phase_pushpull(w, a)
        row["foreign_cpu_frac"] = load.foreign
        pp_rows.append(row)
        log(
            f"  ours push {row['ours']['push_gbps']} pull {row['ours']['pull_gbps']} GB/s,"
            f" plain push {row['plain']['push_gbps']} pull {row['plain']['pull_gbps']} GB/s"
        )
    with Load() as load:
        tcp_times += phase_tcp(a)
    tcp_foreign.append(load.foreign)
    nbytes = int(a.tcp_mib * MiB)
    doc["tcp"] = {
        "mib": a.tcp_mib,
        "ms": median_ms(tcp_times),
        "gbps": gbps(nbytes, median_ms(tcp_times)),
        "best_gbps": gbps(nbytes, min(tcp_times) * 1e3),
        "reps": len(tcp_times),
        "foreign_cpu_frac": tcp_foreign,
        "note": "sendall of a numpy buffer / recv_into a preallocated one, 1-byte ack per"
        " transfer; half the repetitions before push/pull, half after",
    }
    doc["tcp_gbps"] = doc["tcp"]["gbps"]
    log(f"  tcp {doc['tcp_gbps']} GB/s (best {doc['tcp']['best_gbps']})")
    for row in pp_rows:
        row["ratio_vs_tcp"] = round(row["ours"]["push_pull_gbps"] / doc["tcp_gbps"], 3)
        row["push_ratio_vs_tcp"] = round(row["ours"]["push_gbps"] / doc["tcp_gbps"], 3)
        row["pull_ratio_vs_tcp"] = round(row["ours"]["pull_gbps"] / doc["tcp_gbps"], 3)
    head = max(pp_rows, key=lambda r: r["world_size"])
    doc["push_pull"] = {
        "mib": a.tcp_mib,
        "servers": head["servers"],
        "push_gbps": head["ours"]["push_gbps"],
        "pull_gbps": head["ours"]["pull_gbps"],
        "push_pull_gbps": head["ours"]["push_pull_gbps"],
        "tcp_gbps": doc["tcp_gbps"],
        "ratio_vs_tcp": head["ratio_vs_tcp"],
        "goal": ">= 0.7",
        "cpu": "client_cpu_*_ms: the client process's CPU per call (median);"
        " servers_cpu_ms_per_iteration: all W servers' CPU per iteration of push + pull +"
        " set_params (warm-up included)",
        "note": "one client process, servers as separate processes; push = push_grads with SGD"
        " lr=0 step arguments (each push completes a step on the servers); pull ="
        " pull_params; push_pull_gbps = 2 * S / median(push + pull); ratio_vs_tcp ="
        " push_pull_gbps / one raw TCP stream's GB/s (the client uses one connection per"
        " server, so W streams)",
        "by_world_size": pp_rows,
    }
    doc["codec"] = {
        "what": "push + pull of the same buffer: fast_codec servers + ShardClient (hand-encoded"
        " wire format) vs fast_codec=False servers + ShardStub with PushGradRequest("
        "data=arr.tobytes()) / PullParamsReply.data (protobuf bytes fields); same"
        " chunks and calls in flight",
        "mib": a.tcp_mib,
        "servers": head["servers"],
        "fast_ms": head["ours"]["push_pull_ms"],
        "protobuf_ms": head["plain"]["push_pull_ms"],
        "speedup": round(head["plain"]["push_pull_ms"] / head["ours"]["push_pull_ms"], 3),
        "fast_push_ms": head["ours"]["push_ms"],
        "protobuf_push_ms": head["plain"]["push_ms"],
        "fast_pull_ms": head["ours"]["pull_ms"],
        "protobuf_pull_ms": head["plain"]["pull_ms"],
        "by_world_size": [
            {
                "servers": r["servers"],
                "fast_ms": r["ours"]["push_pull_ms"],
                "protobuf_ms": r["plain"]["push_pull_ms"],
                "speedup": round(r["plain"]["push_pull_ms"] / r["ours"]["push_pull_ms"], 3),
            }
            for r in pp_rows
        ],
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "mode",
        nargs="?",
        default="bench",
        choices=["bench", "_rank", "_server", "_gloo", "_tcp_recv", "_tcp_send", "_pushpull"],
        help=argparse.SUPPRESS,
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="one size (16 MiB), 5 repetitions, no separate-server variant (< 2 min)",
    )
    ap.add_argument("--sizes", default=None, help="tensor sizes in MiB (default 1,16,64)")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--reps", type=int, default=0, help="repetitions per cell (default by size)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--tcp-mib",
        type=float,
        default=64.0,
        help="payload of the raw TCP and push/pull measurements",
    )
    ap.add_argument(
        "--gloo-env",
        choices=["default", "tuned"],
        default="tuned",
        help="tuned (default): gloo ranks get MALLOC_ENV too, like ours; default: the plain"
        " environment (gloo then page-faults on its per-call buffers: slower all_gather and"
        " reduce_scatter)",
    )
    ap.add_argument("--no-separate", action="store_true", help="skip the separate-servers variant")
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument(
        "--chunk-mib", type=float, default=CHUNK_BYTES / MiB, help="ShardClient chunk_bytes, MiB"
    )
    ap.add_argument(
        "--in-flight", type=int, default=MAX_IN_FLIGHT, help="ShardClient max_in_flight"
    )
    ap.add_argument(
        "--parts",
        default="transport,collectives",
        help="what to run: transport (raw TCP, push/pull, codec) and/or collectives",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="times each variant runs per world size, alternating order (default 2, --quick 1)",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="before each phase wait up to this many seconds for other processes to"
        " use < 20%% of the CPUs (default: do not wait)",
    )
    ap.add_argument(
        "--max-seconds", type=float, default=0, help="global watchdog (default 1200, --quick 300)"
    )
    # child options
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--run-id", default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--host-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--init-file", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mib", type=float, default=64.0, help=argparse.SUPPRESS)
    ap.add_argument("--lifetime", type=float, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.sizes = parse_list(a.sizes, float) if a.sizes else ([16.0] if a.quick else [1.0, 16.0, 64.0])
    a.world_sizes = parse_list(a.world_sizes, int)
    a.parts = parse_list(a.parts, str)
    a.chunk_bytes = max(4096, int(a.chunk_mib * MiB))
    if not a.parts or set(a.parts) - {"transport", "collectives"}:
        ap.error("--parts takes transport and/or collectives")
    if a.quick:
        a.no_separate = True
    a.rounds = a.rounds or (1 if a.quick else 2)
    waits = (1 + len(a.world_sizes) * a.rounds * 3) * max(0.0, a.wait_quiet)
    a.max_seconds = a.max_seconds or (300.0 if a.quick else 1200.0) + waits

    if a.mode != "bench":
        child_guard(a.lifetime or 1800.0)
        {
            "_rank": rank_main,
            "_server": server_main,
            "_gloo": gloo_main,
            "_tcp_recv": tcp_recv_main,
            "_tcp_send": tcp_send_main,
            "_pushpull": pushpull_main,
        }[a.mode](a)
        return 0

    if any(w < 1 for w in a.world_sizes) or any(s <= 0 for s in a.sizes):
        ap.error("sizes and world sizes must be positive")
    a.lifetime = a.max_seconds + 60  # children outlive no parent: they also watch getppid()

    install_cleanup()

    def on_timeout() -> None:
        log(f"global watchdog: {a.max_seconds:.0f} s exceeded; stopping children")
        stop_all(timeout=3)
        os._exit(4)

    wd = threading.Timer(a.max_seconds, on_timeout)
    wd.daemon = True
    wd.start()
    try:
        return bench_main(a)
    except ChildError as exc:
        log(f"FAILED: {exc}")
        return 1
    finally:
        wd.cancel()
        stop_all(timeout=5)


if __name__ == "__main__":
    sys.exit(main())
