"""A cost model of our parameter-server collectives and training steps against ring and tree
all-reduce, fitted to this machine's measurements and extended to 1,024 hosts.

    python -m benchmarks.cost_model --collectives COLL.json [--scale SCALE.json] [--markdown]

1. **Fit** (``fit``): from ``benchmarks.collectives`` run with its namespaces, the W = 2 cells
   with unlimited links (two "hosts" on the machine's two cores: one core each), ours and
   gloo's median time of every op and size as ``a x messages a host handles + b x
   bytes its processes copy`` (least squares of relative errors; the counts are
   ``benchmarks/_cost_counts.py``'s).
   The CPU fit is the model's: a host's CPU per op does not depend on how the lab shares its
   cores, while the lab's times do.
2. **Check** (``check``): every other cross-namespace cell of that run (W = 4, and every link
   rate), its CPU per host predicted from the counts and its time as ``max(CPU, bytes over a
   link / its rate + the per-message part)``, the rate being what one raw TCP stream moved
   across the shaped link in the same run (W = 4: four hosts on two cores, so twice the time),
   against what was measured; the held-out cells within 20% are counted, by side, W and rate,
   and, where the run recorded it, by the steal of the cell's phase (``phases[].steal_frac``:
   on a virtual machine the hypervisor's share, which rises with the host's load and with
   a benchmark's own wake-ups, benchmarks/_cpu.py ``Load``): a phase that lost 10% or more of
   the CPUs to it is not the machine the fit measured.
3. **Predict** (``predict``): for 8 to 1,024 hosts at 10, 25 and 100 Gbit/s, one rank and one
   server per host with ``--host-cores`` cores for communication (default 1, as the W = 2 lab's
   hosts), each model's step: DDP, ZeRO-2 and FSDP through our servers (``max(CPU, link)`` +
   nothing for latency: two round trips overlap with the transfer), and DDP's all-reduce as a
   ring and as a tree with gloo's CPU costs plus a 25 us hop per step in sequence; time spent
   communicating and its share of a step whose compute is ``6 x params x tokens /
   --host-tflops`` (a GPU host; ``--tokens`` per rank) or, with ``--scale``, this machine's
   measured compute per step. Both sides' CPU costs include the lab's kernel path (veth and a
   software bridge, no NIC offloads), so both are pessimistic for a real NIC alike.
4. **Check against training steps** (``--scale``, benchmarks/_cost_steps.py): the costs of a
   message and a byte between processes of one host fitted the same way on the collectives
   run's W = 2 rows through separate servers (``fit_host``), the W > 2 rows held out; then
   every cell of the scale run predicted from a rank's compute alone (its
   ``compute_reference``) and those costs, against its measured step and CPU.

Prints JSON (``--markdown``: the tables of docs/scaling.md instead). Nothing here is measured:
it reads the JSON of the benchmarks, whose commands and machine it repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from benchmarks import _cost_counts as cc
from benchmarks import _cost_steps

MiB = 2**20
HOSTS = (8, 16, 32, 64, 128, 256, 512, 1024)
RATES = (10.0, 25.0, 100.0)
HOP_S = 25e-6  # one way, a data-centre hop (benchmarks/_netns.py DELAY_US)
PARAMS = {  # parameters and FSDP units (blocks) of benchmarks/_scale_models.py's models
    "gpt2-124m": (124_439_808, 12),
    "gpt2-355m": (354_823_168, 24),
    "llama-1b": (1_038_682_112, 16),
}


# ================================================================================ the fit
LAB_CORES = 2  # the machine the lab runs on: every host's processes share its cores
QUIET_STEAL = 0.1  # a phase that lost less of the CPUs to the hypervisor is counted as quiet


def _lstsq(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Non-negative (a, b) minimising sum ((a x + b y - z) / z)^2 (relative errors)."""
    sxx = sxy = syy = sxz = syz = 0.0
    for x, y, z in rows:
        wgt = 1.0 / max(z, 1e-9) ** 2
        sxx, sxy, syy = sxx + wgt * x * x, sxy + wgt * x * y, syy + wgt * y * y
        sxz, syz = sxz + wgt * x * z, syz + wgt * y * z
    det = sxx * syy - sxy * sxy
    if det <= 0:
        return max(0.0, sxz / sxx if sxx else 0.0), 0.0
    a, b = (sxz * syy - syz * sxy) / det, (syz * sxx - sxz * sxy) / det
    if a < 0:
        return 0.0, max(0.0, syz / syy)
    if b < 0:
        return max(0.0, sxz / sxx), 0.0
    return a, b


def chunk_of(doc: dict[str, Any]) -> int:
    """The chunk the run's clients sent across the namespaces: the one it names, or the
    clients' default there (``client.chunk_mib_netns``), or ``cc.CHUNK_BEFORE`` for JSON that
    says neither."""
    client = doc.get("client") or {}
    mib = client.get("chunk_mib") or client.get("chunk_mib_netns")
    return int(mib * MiB) if mib else cc.CHUNK_BEFORE


def _netns_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = doc.get("netns", {}).get("results") or []
    if not rows:
        raise SystemExit("the collectives JSON has no cross-namespace rows (run it as root)")
    return rows


def fit(doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per side, from the W = 2 rows with unlimited links (two hosts, one core each: the
    machine's two), two fits of ``a x messages a host handles + b x bytes its
    processes copy`` (least squares of relative errors): of the median wall time (``s_per_*``,
    the lab's time, kernel networking included) and of the CPU seconds of a host's processes
    (``cpu_s_per_*``: a rank and, ours, its share of the servers; user and system time)."""
    rows = [r for r in _netns_rows(doc) if r.get("rate_gbit") is None and r["world_size"] == 2]
    chunk = chunk_of(doc)
    fused = cc.fused_reads(doc.get("client") or {})
    return {side: _fit_side(rows, side, f"{side}_ns", chunk, fused) for side in ("ours", "gloo")}


def fit_host(doc: dict[str, Any]) -> dict[str, dict[str, float]] | None:
    """The same two fits from the run's rows between processes of one host (``results``, W =
    2: ours through 2 separate servers and shared memory, ``ours_sep``; gloo over loopback),
    counted with the run's chunk or its clients' default for 2 servers on one host. What a
    step of ``benchmarks.scale`` costs (benchmarks/_cost_steps.py); None without such rows
    (a run with ``--no-separate``)."""
    rows = [r for r in doc.get("results") or [] if r["world_size"] == 2 and "ours_sep_ms" in r]
    if not rows or "gloo_ms" not in rows[0]:
        return None
    chunk = cc.run_chunk(doc.get("client") or {}, 2, "chunk_mib_same_host")
    fused = cc.fused_reads(doc.get("client") or {})
    return {
        "ours": _fit_side(rows, "ours", "ours_sep", chunk, fused),
        "gloo": _fit_side(rows, "gloo", "gloo", chunk, fused),
    }


def _fit_side(
    rows: list[dict[str, Any]], side: str, key: str, chunk: int, fused: bool
) -> dict[str, float]:
    wall, cpu = [], []
    for r in rows:
        w = r["world_size"]
        msgs, handled, _ = cc.op_counts(side, r["op"], r["mib"] * MiB, w, chunk, fused)
        wall.append((msgs, handled, r[f"{key}_ms"] / 1e3))
        cpu.append((msgs, handled, r[f"{key}_cpu_ms_per_rank"] / 1e3))
    per_msg, per_byte = _lstsq(wall)
    cpu_msg, cpu_byte = _lstsq(cpu)
    return {
        "s_per_message": per_msg,
        "s_per_byte": per_byte,
        "cpu_s_per_message": cpu_msg,
        "cpu_s_per_byte": cpu_byte,
        "cpu_gb_per_s_per_core": 1e-9 / cpu_byte if cpu_byte else math.inf,
        "fitted_on": len(wall),
    }


# ================================================================================ the check
def lab_time(
    side: str, c: dict[str, float], op: str, nbytes: float, w: int, rate: Any,
    chunk: int | None = None, fused: bool = True,
) -> float:  # fmt: skip
    """Predicted wall seconds of one op in the lab: each of W hosts gets LAB_CORES / W cores
    (at most one), links moving ``rate`` Gbit/s (None: unlimited, their cost is the CPU's)."""
    msgs, handled, wire = cc.op_counts(side, op, nbytes, w, chunk, fused)
    slow = max(1.0, w / LAB_CORES)  # hosts sharing the machine's cores
    cpu = (c["s_per_message"] * msgs + c["s_per_byte"] * handled) * slow
    link = wire * 8 / (rate * 1e9) if rate else 0.0
    return max(cpu, link + c["s_per_message"] * msgs * slow)


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
        g[0] += abs(r["error"]) <= 0.2
        g[1] += abs(r["cpu_error"]) <= 0.2
        g[2] += 1
    return {k: f"time {a}, CPU {b} of {n}" for k, (a, b, n) in groups.items()}


def _steal_group(r: dict[str, Any]) -> str | None:
    """A row's side and whether its phase was quiet (``QUIET_STEAL``); None unrecorded."""
    if r.get("phase_steal") is None:
        return None
    quiet = "under" if r["phase_steal"] < QUIET_STEAL else "at or over"
    return f"{r['side']}, steal {quiet} {QUIET_STEAL:.0%}"


def check(doc: dict[str, Any], costs: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Every held-out cell's time predicted with the link's measured rate (``link_rates``);
    each row carries its phase's steal where the run recorded it (``phase_steal``)."""
    rows, within, held = [], 0, 0
    measured, chunk = link_rates(doc), chunk_of(doc)
    steal = phase_steal(doc)
    fused = cc.fused_reads(doc.get("client") or {})
    for r in _netns_rows(doc):
        fitted = r.get("rate_gbit") is None and r["world_size"] == 2
        link = measured.get(r.get("rate_gbit"), r.get("rate_gbit"))
        for side in ("ours", "gloo"):
            variant = f"{side}_ns"  # its phase's name; its rows' keys start so
            key = f"{variant}_ms"
            if key not in r:
                continue
            c, nbytes, w = costs[side], r["mib"] * MiB, r["world_size"]
            pred = lab_time(side, c, r["op"], nbytes, w, link, chunk, fused) * 1e3
            msgs, handled, _ = cc.op_counts(side, r["op"], nbytes, w, chunk, fused)
            cpu = cc.cpu_s(c, msgs, handled) * 1e3
            err = pred / r[key] - 1
            cpu_err = cpu / max(r[f"{side}_ns_cpu_ms_per_rank"], 1e-6) - 1
            if not fitted:
                held += 1
                within += abs(err) <= 0.2
            rows.append({"side": side, "op": r["op"], "world_size": w,
                         "bytes": round(nbytes), "rate_gbit": r.get("rate_gbit"),
                         "link_gbit": link,
                         "measured_ms": r[key], "predicted_ms": round(pred, 3),
                         "error": round(err, 3), "fitted": fitted,
                         "measured_cpu_ms": r[f"{side}_ns_cpu_ms_per_rank"],
                         "predicted_cpu_ms": round(cpu, 3),
                         "cpu_error": round(cpu_err, 3),
                         "phase_steal": steal.get((variant, w, r.get("rate_gbit")))})  # fmt: skip
    by_group = _tally(
        rows, lambda r: f"{r['side']} W={r['world_size']} {r['rate_gbit'] or 'unlimited'}"
    )
    return {
        "rows": rows,
        "held_out_within_20pct": within,
        "held_out_cells": held,
        "by_group": by_group,
        "fit_phase_steal": {s: steal.get((f"{s}_ns", 2, None)) for s in ("ours", "gloo")},
        "by_steal": dict(sorted(_tally(rows, _steal_group).items())),
        "link_gbit_measured": measured,
    }


# ================================================================================ prediction
def comm_seconds(
    kind: str, psi: float, w: int, gbit: float, costs: dict[str, dict[str, float]], a: Any,
    units: int,
) -> float:  # fmt: skip
    """A step's communication time for ``kind`` (ddp, zero2, fsdp: ours; ring, tree: gloo's
    costs) on W hosts at ``gbit`` Gbit/s, one rank and ``a.servers_per_host`` servers a host
    with ``a.host_cores`` cores for communication (the fit's host had one)."""
    side = "gloo" if kind in ("ring", "tree") else "ours"
    c = costs[side]
    t = cc.step_traffic(kind, psi, w, units=units, s=a.servers_per_host, bucket=a.bucket)
    # ours: a host handles its rank's messages and its servers' (each W x its parts)
    msgs = t.messages + t.server_messages * a.servers_per_host if side == "ours" else t.messages
    cpu = cc.cpu_s(c, msgs, t.handled_bytes) / a.host_cores
    hops = t.round_trips * 2 * HOP_S if side == "gloo" else 0.0  # ring / tree: in sequence
    link = t.wire_bytes * 8 / (gbit * 1e9)
    return max(cpu, link) + hops


def predict(costs: dict[str, dict[str, float]], a: Any, compute: dict[str, float]) -> list:
    out = []
    for model, (psi, units) in PARAMS.items():
        for gbit in RATES:
            for w in HOSTS:
                row: dict[str, Any] = {"model": model, "gbit": gbit, "hosts": w}
                row["compute_s"] = compute[model]
                for kind in ("ddp", "zero2", "fsdp", "ring", "tree"):
                    s = comm_seconds(kind, psi, w, gbit, costs, a, units)
                    row[f"{kind}_comm_s"] = round(s, 4)
                    row[f"{kind}_share"] = round(s / (s + compute[model]), 3)
                out.append(row)
    return out


def compute_times(a: Any) -> dict[str, float]:
    """Seconds of compute per rank and step: measured (``--scale``: rank 0's compute of our
    FSDP cell, or torch's forward + backward) or 6 x params x tokens / host FLOP/s."""
    out = {m: 6 * psi * a.tokens / (a.host_tflops * 1e12) for m, (psi, _) in PARAMS.items()}
    if a.scale:
        doc = json.load(open(a.scale))
        for r in doc.get("results", []):
            b = r.get("torch_breakdown_ms") or {}
            if r.get("model") in out and r.get("world_size") == 2 and b:
                out[r["model"]] = (b.get("forward", 0) + b.get("backward", 0)) / 1e3
    return out


def markdown(result: dict[str, Any]) -> str:
    head = "| side | lab time a message | lab time a byte | CPU a message | CPU a byte (GB/s) |"
    lines = [head, "|---|---|---|---|---|"]
    for side, c in result["costs"].items():
        lines.append(
            f"| {side} | {c['s_per_message'] * 1e3:.3f} ms | {c['s_per_byte'] * 1e9:.3f} ns"
            f" | {c['cpu_s_per_message'] * 1e3:.3f} ms | {c['cpu_s_per_byte'] * 1e9:.3f} ns"
            f" ({c['cpu_gb_per_s_per_core']:.2f}) |"
        )
    chk = result["check"]
    lines.append(
        f"\nHeld-out cells within 20%: {chk['held_out_within_20pct']} of {chk['held_out_cells']}"
    )
    lines += ["", "| held-out cells | within 20% |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in chk["by_group"].items()]
    if chk["by_steal"]:
        fit = ", ".join(f"{s} {v:.0%}" for s, v in chk["fit_phase_steal"].items() if v is not None)
        lines += ["", f"| held-out cells by their phase's steal (fitted on: {fit}) | within 20% |"]
        lines += ["|---|---|", *(f"| {k} | {v} |" for k, v in chk["by_steal"].items())]
    moved = [f"{k:g} Gbit/s moved {v:.2f}" for k, v in chk["link_gbit_measured"].items()]
    if moved:
        lines.append("\nOne raw TCP stream across links shaped to " + "; ".join(moved) + ".")
    if "steps" in result:
        lines += _cost_steps.markdown(result)
    for model in PARAMS:
        lines.append(f"\n**{model}** (compute {result['compute_s'][model]:.3g} s a step)\n")
        lines.append("| Gbit/s | hosts | DDP ours | ZeRO-2 ours | FSDP ours | ring | tree |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in result["prediction"]:
            if r["model"] == model:
                cells = [f"{r[f'{k}_comm_s'] * 1e3:.0f} ms ({100 * r[f'{k}_share']:.0f}%)"
                         for k in ("ddp", "zero2", "fsdp", "ring", "tree")]  # fmt: skip
                lines.append(f"| {r['gbit']:g} | {r['hosts']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--collectives", required=True, help="benchmarks.collectives JSON (as root)")
    p.add_argument(
        "--scale",
        help="benchmarks.scale JSON: this machine's compute per step, and its cells, which the"
        " steps check predicts (benchmarks/_cost_steps.py)",
    )
    p.add_argument(
        "--host-cores",
        type=float,
        default=1.0,
        help="cores a host gives to communication (the fit's: 1)",
    )
    p.add_argument("--servers-per-host", type=int, default=1)
    p.add_argument("--bucket", type=int, default=cc.BUCKET, help="bucket bytes (DDP, ZeRO-2)")
    p.add_argument("--in-flight", type=int, default=8, help="calls a rank keeps in flight")
    p.add_argument("--tokens", type=int, default=8 * 1024, help="tokens per rank and step")
    p.add_argument("--host-tflops", type=float, default=100.0, help="a host's effective TFLOP/s")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    if a.bucket < 2**16 or a.servers_per_host < 1:  # a few bytes: millions of buckets a step
        p.error(
            "--bucket is in bytes (at least 65536; 100 MiB is 104857600) and"
            " --servers-per-host at least 1"
        )
    doc = json.load(open(a.collectives))
    costs = fit(doc)
    result = {
        "source": {"collectives": a.collectives, "machine": doc.get("machine"), "scale": a.scale},
        "costs": costs,
        "check": check(doc, costs),
        "assumptions": {
            k: getattr(a, k)
            for k in (
                "host_cores",
                "servers_per_host",
                "bucket",
                "in_flight",
                "tokens",
                "host_tflops",
            )
        }
        | {"hop_s": HOP_S},  # fmt: skip
        "compute_s": compute_times(a),
    }
    result["prediction"] = predict(costs, a, result["compute_s"])
    if a.scale:
        host = fit_host(doc)
        result["costs_same_host"] = host
        result["check_same_host"] = _cost_steps.check_host(doc, host) if host else None
        result["steps"] = (
            _cost_steps.check_steps(json.load(open(a.scale)), host)
            if host
            else "the collectives JSON has no rows through separate servers on one host"
        )
    if a.markdown:
        print(markdown(result))
    else:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
