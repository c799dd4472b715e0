"""A cost model of our parameter-server collectives and training steps against ring and tree
all-reduce, fitted to this machine's measurements and extended to 1,024 hosts.

    python -m benchmarks.cost_model --collectives COLL.json [COLL2.json ...]
        [--held-out LATER.json ...] [--scale SCALE.json] [--markdown]

1. **Fit** (``fit``): from ``benchmarks.collectives`` run with its namespaces, the W = 2 cells
   with unlimited links (two "hosts" on the machine's two cores: one core each), ours and
   gloo's time of every op and size (each cell's median over the runs given) as ``a x
   messages a host handles + b x bytes its processes copy`` (least squares of relative
   errors; the counts are ``benchmarks/_cost_counts.py``'s).
   The CPU fit is the model's: a host's CPU per op does not depend on how the lab shares its
   cores, while the lab's times do.
2. **Check** (benchmarks/_cost_check.py): every other cross-namespace cell of those runs (W =
   4, and every link rate) predicted from the fitted costs and the link's measured rate,
   against what was measured; the held-out cells within 20% counted by side, W and rate, run,
   and the steal of the cell's phase. ``--held-out`` runs are not fitted: every cell of them
   is checked.
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
   runs' W = 2 rows through separate servers (``fit_host``), the W > 2 rows held out; then
   every cell of the scale run predicted from a rank's compute alone (its
   ``compute_reference``) and those costs, against its measured step and CPU.

Prints JSON (``--markdown``: the tables of docs/scaling.md instead). Nothing here is measured:
it reads the JSON of the benchmarks, whose commands and machine it repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import Any

from benchmarks import _cost_check as ck
from benchmarks import _cost_counts as cc
from benchmarks import _cost_steps

HOSTS = (8, 16, 32, 64, 128, 256, 512, 1024)
RATES = (10.0, 25.0, 100.0)
HOP_S = 25e-6  # one way, a data-centre hop (benchmarks/_netns.py DELAY_US)
PARAMS = {  # parameters and FSDP units (blocks) of benchmarks/_scale_models.py's models
    "gpt2-124m": (124_439_808, 12),
    "gpt2-355m": (354_823_168, 24),
    "llama-1b": (1_038_682_112, 16),
}


# ================================================================================ the fit
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


Cells = dict[tuple[str, float, float, float], list[tuple[float, float]]]


def _add_cells(cells: Cells, rows: list, side: str, key: str, chunk: int, fused: bool) -> None:
    """Each row's (wall s, CPU s) under its cell: its op, size and counts (runs counted with
    another chunk are other cells)."""
    for r in rows:
        nbytes, w = ck.tensor_bytes(r), r["world_size"]
        msgs, handled, _ = cc.op_counts(side, r["op"], nbytes, w, chunk, fused)
        got = (r[f"{key}_ms"] / 1e3, r[f"{key}_cpu_ms_per_rank"] / 1e3)
        cells.setdefault((r["op"], r["mib"], msgs, handled), []).append(got)


def fit(docs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per side, from the W = 2 rows with unlimited links of every run in ``docs`` (two hosts,
    one core each: the machine's two), each cell's median over the runs, two fits of ``a x
    messages a host handles + b x bytes its processes copy`` (least squares of relative
    errors): of the wall time (``s_per_*``, the lab's time, kernel networking included) and of
    the CPU seconds of a host's processes (``cpu_s_per_*``: a rank and, ours, its share of the
    servers; user and system time). One run's fit carries whatever its fit phase met (a slow
    phase, the hypervisor's steal); the median of three is steadier (docs/scaling.md)."""
    out = {}
    for side in ("ours", "gloo"):
        cells: Cells = {}
        for doc in docs:
            rows = [r for r in ck.netns_rows(doc) if ck.is_fitted(r)]
            fused = cc.fused_reads(doc.get("client") or {})
            _add_cells(cells, rows, side, f"{side}_ns", ck.chunk_of(doc), fused)
        out[side] = _fit_side(cells, len(docs))
    return out


def fit_host(docs: list[dict[str, Any]]) -> dict[str, dict[str, float]] | None:
    """The same two fits from the runs' rows between processes of one host (``results``, W =
    2: ours through 2 separate servers and shared memory, ``ours_sep``; gloo over loopback),
    counted with each run's chunk or its clients' default for 2 servers on one host. What a
    step of ``benchmarks.scale`` costs (benchmarks/_cost_steps.py); None without such rows
    (runs with ``--no-separate``)."""
    cells: dict[str, Cells] = {"ours": {}, "gloo": {}}
    runs = 0
    for doc in docs:
        rows = [r for r in doc.get("results") or [] if r["world_size"] == 2 and "ours_sep_ms" in r]
        if not rows or "gloo_ms" not in rows[0]:
            continue
        runs += 1
        client = doc.get("client") or {}
        chunk, fused = cc.run_chunk(client, 2, "chunk_mib_same_host"), cc.fused_reads(client)
        _add_cells(cells["ours"], rows, "ours", "ours_sep", chunk, fused)
        _add_cells(cells["gloo"], rows, "gloo", "gloo", chunk, fused)
    return {side: _fit_side(c, runs) for side, c in cells.items()} if runs else None


def _fit_side(cells: Cells, runs: int) -> dict[str, float]:
    wall = [(m, h, statistics.median(t for t, _ in got)) for (_, _, m, h), got in cells.items()]
    cpu = [(m, h, statistics.median(c for _, c in got)) for (_, _, m, h), got in cells.items()]
    per_msg, per_byte = _lstsq(wall)
    cpu_msg, cpu_byte = _lstsq(cpu)
    return {
        "s_per_message": per_msg,
        "s_per_byte": per_byte,
        "cpu_s_per_message": cpu_msg,
        "cpu_s_per_byte": cpu_byte,
        "cpu_gb_per_s_per_core": 1e-9 / cpu_byte if cpu_byte else math.inf,
        "fitted_on": len(wall),
        "runs": runs,
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
    lines += [f"| {k} | {v} |" for k, v in (chk["by_group"] | chk["by_run"]).items()]
    if chk["spread"]:
        lines += [
            "",
            f"| cells measured in {ck.SPREAD_RUNS} runs or more (fitted ones too) | within"
            " 20% of their median over the runs |",
            "|---|---|",
        ]
        lines += [f"| {k} | {v} |" for k, v in chk["spread"].items()]
    if chk["by_steal"]:
        fit = "; ".join(
            f"{s} " + ", ".join("–" if v is None else f"{v:.0%}" for v in steals)
            for s, steals in chk["fit_phase_steal"].items()
        )
        lines += ["", f"| held-out cells by their phase's steal (fitted on: {fit}) | within 20% |"]
        lines += ["|---|---|", *(f"| {k} | {v} |" for k, v in chk["by_steal"].items())]
    for i, rates in enumerate(chk["link_gbit_measured"], 1):
        moved = [f"{k:g} Gbit/s moved {v:.2f}" for k, v in rates.items()]
        if moved:
            run = f" (run {i})" if len(chk["link_gbit_measured"]) > 1 else ""
            moved_s = "; ".join(moved)
            lines.append(f"\nOne raw TCP stream{run} across links shaped to {moved_s}.")
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
    p.add_argument(
        "--collectives",
        required=True,
        nargs="+",
        help="benchmarks.collectives JSON (as root), one or more runs: the fit takes each cell's"
        " median over them, the check counts every run's held-out cells",
    )
    p.add_argument(
        "--held-out",
        nargs="*",
        default=[],
        help="more benchmarks.collectives JSON that the fit does not see: every cell of these"
        " runs is checked against the costs fitted on --collectives",
    )
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
    docs = [json.load(open(path)) for path in a.collectives]
    held = [json.load(open(path)) for path in a.held_out]
    costs = fit(docs)
    result = {
        "source": {
            "collectives": a.collectives,
            "held_out": a.held_out,
            "machine": [doc.get("machine") for doc in docs + held],
            "scale": a.scale,
        },
        "costs": costs,
        "check": ck.check(docs + held, costs, whole=len(held)),
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
        host = fit_host(docs)
        result["costs_same_host"] = host
        result["check_same_host"] = _cost_steps.check_host(docs, host) if host else None
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
