"""benchmarks/collectives.py's child processes and its transport section: one raw TCP stream (the
reference) and push/pull of a flat buffer to W shard servers, each in processes of its own."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks._collective_ranks import (
    MiB,
)
from benchmarks._cpu import Load, proc_cpu_s
from benchmarks._processes import Child, child_env, expect_all, logger, serve_processes, stop_all

log = logger("collectives")


def median_ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 3)


def gbps(nbytes: int, ms: float | None) -> float | None:
    return None if not ms else round(nbytes / (ms / 1e3) / 1e9, 3)


def child(
    name: str, argv: list[str], env: dict[str, str], lifetime: float, prefix: Sequence[str] = ()
) -> Child:
    """A child running one mode of this module (inside a namespace: ``prefix``)."""
    return Child.module(name, "benchmarks.collectives", argv, env, lifetime, prefix)


def start_servers(
    w: int, plain: bool, a: argparse.Namespace, tag: str
) -> tuple[list[Child], list[str]]:
    """W server processes: ``paramshard serve``, or (``plain``) the plain-protobuf server mode."""
    if not plain:
        return serve_processes(w, 60)
    kids = [
        child(f"{tag}server{i}", ["_server", "--plain"], child_env(True), a.lifetime)
        for i in range(w)
    ]
    return kids, expect_all(kids, "ADDR", 60, watch=kids)


def phase_tcp(
    a: argparse.Namespace, lab: Any = None, reps: int = 0, mib: float = 0.0
) -> list[float]:
    """Seconds per transfer of one raw TCP stream (sender and receiver processes): on loopback,
    or (``lab``) from host h0's namespace to h1's across the lab's bridge and links."""
    env = child_env(True)
    mib = mib or a.tcp_mib
    at_recv, at_send, addr = (), (), "127.0.0.1"
    if lab is not None:
        at_recv, at_send, addr = lab.exec_prefix("h1"), lab.exec_prefix("h0"), lab.ip["h1"]
    recv = child("tcprecv", ["_tcp_recv", "--bind", addr], env, a.lifetime, at_recv)
    kids = [recv]
    try:
        port = recv.expect("PORT", 60)
        reps = reps or (5 if a.quick else 20)
        argv = ["_tcp_send", "--port", port, "--to", addr, "--mib", str(mib),
                "--reps", str(reps), "--warmup", "2"]  # fmt: skip
        send = child("tcpsend", argv, env, a.lifetime, at_send)
        kids.append(send)
        t = json.loads(send.expect("RESULT", 120))["t"]
    finally:
        stop_all(kids)
    return t


def link_gbit(a: argparse.Namespace, lab: Any, mib: float = 64.0, reps: int = 10) -> float:
    """What one raw TCP stream moves across the lab's link from host h0 to h1 (Gbit/s, the
    median of ``reps`` transfers of ``mib`` MiB): the link's real rate, which a shaped lab on
    busy cores keeps below its nominal one (the token buckets' timers run on the same cores)."""
    t = phase_tcp(a, lab, reps=reps, mib=mib)
    return round(mib * MiB * 8 / statistics.median(t) / 1e9, 3)


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
    for k in ("ours", "ours_inband", "plain"):
        r = res[k]
        push, pull, setp = median_ms(r["push"]), median_ms(r["pull"]), median_ms(r["set"])
        both = [x + y for x, y in zip(r["push"], r["pull"], strict=True)]
        moved = [x + y for x, y in zip(r["set"], r["pull"], strict=True)]
        out[k] = {
            "push_ms": push,
            "pull_ms": pull,
            "push_pull_ms": median_ms(both),
            "set_params_ms": setp,
            "push_gbps": gbps(nbytes, push),
            "pull_gbps": gbps(nbytes, pull),
            "set_params_gbps": gbps(nbytes, setp),
            "push_pull_gbps": gbps(2 * nbytes, median_ms(both)),
            "set_pull_gbps": gbps(2 * nbytes, median_ms(moved)),
            "client_cpu_push_ms": median_ms(r["push_cpu"]),
            "client_cpu_pull_ms": median_ms(r["pull_cpu"]),
            "verified": r["ok"],
            "reps": len(r["push"]),
        }
    # ours and ours_inband share the servers: their CPU is of one iteration of both
    out["ours"]["servers_cpu_ms_per_iteration_with_inband"] = round(server_cpu["ours"] * 1e3, 1)
    out["plain"]["servers_cpu_ms_per_iteration"] = round(server_cpu["plain"] * 1e3, 1)
    out["client_malloc_env"] = bool(res["malloc_env"])
    return out


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
        row["set_pull_ratio_vs_tcp"] = round(row["ours"]["set_pull_gbps"] / doc["tcp_gbps"], 3)
        row["inband_ratio_vs_tcp"] = round(
            row["ours_inband"]["push_pull_gbps"] / doc["tcp_gbps"], 3
        )
    head = max(pp_rows, key=lambda r: r["world_size"])
    doc["push_pull"] = {
        "mib": a.tcp_mib,
        "servers": head["servers"],
        "push_gbps": head["ours"]["push_gbps"],
        "pull_gbps": head["ours"]["pull_gbps"],
        "push_pull_gbps": head["ours"]["push_pull_gbps"],
        "tcp_gbps": doc["tcp_gbps"],
        "ratio_vs_tcp": head["ratio_vs_tcp"],
        "set_pull_gbps": head["ours"]["set_pull_gbps"],
        "set_pull_ratio_vs_tcp": head["set_pull_ratio_vs_tcp"],
        "inband_push_pull_gbps": head["ours_inband"]["push_pull_gbps"],
        "inband_ratio_vs_tcp": head["inband_ratio_vs_tcp"],
        "goal": ">= 1.0 (issue 14)",
        "cpu": "client_cpu_*_ms: the client process's CPU per call (median);"
        " servers_cpu_ms_per_iteration: all W servers' CPU per iteration of push + pull +"
        " set_params (warm-up included)",
        "note": "one client process, servers as separate processes; ours: payloads through"
        " shared segments, ours_inband: the same client with shared_memory=False (every"
        " payload in the gRPC message); set_pull_* : set_params + pull_params, the transport"
        " alone (a push also runs the optimizer step on the servers); push = push_grads with SGD"
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
