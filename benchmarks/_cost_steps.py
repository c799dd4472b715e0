"""The cost model's check against training steps: every cell of a ``benchmarks.scale`` run
(W rank processes and, ours, W server processes on this host, payloads through shared memory)
predicted from a rank's compute alone and what a message and a byte cost between processes of
one host (``cost_model.fit_host``: a collectives run's W = 2 rows, ours through separate
servers, gloo over loopback), and compared with the step and the CPU the cell measured.
``check_host`` checks the same-host fit itself on the collectives rows it did not see (W > 2).

For a cell (model of Ψ parameters, strategy, W), with F the forward and backward of one rank
and O the AdamW step over all Ψ, both CPU seconds of a compute alone (one process, no peers):
the cell's own (``compute_beside``, measured between its two sides) where the run has it,
else the run's (``compute_reference``, once a model):

- **CPU a step**, every process of the cell together: W F + O x (W for DDP, whose ranks each
  step the whole model; 1 for the sharded strategies, whose servers, or torch's ranks, each
  step 1/W) + W x a rank's communication. Ours: ``_cost_counts.step_traffic`` (ZeRO-1 pushes
  the gradient that ZeRO-2 pushes and pulls the same parameters, at the step instead of during
  backward: the same counts), each message counted at both ends (a rank and its share of the
  servers, as the fit counted them). Torch's on gloo: DDP's ring all-reduce of the gradient
  in 25 MiB buckets; ``ZeroRedundancyOptimizer`` adds the broadcast of the updated
  parameters, counted as an all-gather of them; FSDP2 two all-gathers and a reduce-scatter of
  each block.
- **Step**: ``max(CPU / cores, F + O on one rank's path)`` (O on the path: DDP's whole, 1/W
  else). With more processes than cores a step takes the CPU all of them spend
  (docs/benchmarks.md, "W=8 on two cores"); with a core each, a rank's own work.

What the counts leave out, and so what the check's errors from the compute alone show: the
overlap of communication with compute on a rank with a core to itself, waits, copies outside
the counted collectives (torch's FSDP2 copies into and out of its gather buffers; our
flattening of gradients) and each strategy's own work on its ranks and servers. ``check_steps``
measures that last part once a strategy, as an overhead a rank fitted at the smallest W, and
``overhead_where`` splits every cell's into the training thread's and the rest's (the threads'
CPU the scale run read from /proc).
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks import _cost_counts as cc
from benchmarks._cost_check import WITHIN, tensor_bytes

SIDES = ("ours", "torch")


def units_of(config: dict[str, Any]) -> int:
    """FSDP's gathered blocks of a scale model (``_scale_models.MODELS[m].config``; GPT-2's
    default 12 layers when the config leaves it to ``GPT2Config``)."""
    return int(config.get("n_layer") or config.get("num_hidden_layers") or 12)


def gloo_counts(strategy: str, psi: float, w: int, units: int) -> tuple[float, float]:
    """(messages, bytes copied) of one rank of torch's twin on gloo for a step."""
    grad = 4 * psi
    buckets = max(1, math.ceil(grad / cc.BUCKET))
    parts: list[tuple[str, float, int]]  # (op, bytes, times)
    if strategy == "fsdp":
        parts = [("all_gather", grad / units, 2 * units), ("reduce_scatter", grad / units, units)]
    else:
        parts = [("all_reduce", grad / buckets, buckets)]
        if strategy in ("zero1", "zero2"):
            parts.append(("all_gather", grad, 1))
    steps = handled = 0.0
    for op, nbytes, times in parts:
        s, h, _ = cc.op_counts("gloo", op, nbytes, w)
        steps, handled = steps + times * s, handled + times * h
    return steps, handled


def ours_counts(
    strategy: str, psi: float, w: int, units: int, chunk: int, fused: bool = True
) -> tuple[float, float]:
    """(messages a rank and its share of the servers handle, bytes they copy) of ours
    (``fused``: ``_cost_counts.fused_reads``)."""
    kind = "zero2" if strategy == "zero1" else strategy
    t = cc.step_traffic(kind, psi, w, units=units, s=1, chunk=chunk, fused=fused)
    return t.messages + t.server_messages, t.handled_bytes


def predict_cell(
    row: dict[str, Any], ref: dict[str, Any], costs: dict[str, dict[str, float]],
    psi: float, units: int, chunk: int, cores: int, extra: dict[str, float] | None = None,
    fused: bool = True,
) -> dict[str, float]:  # fmt: skip
    """Predicted step and CPU (seconds) of both sides of one scale cell; ``extra``: CPU seconds
    a rank and step each side spends beyond its compute alone and its counted messages and
    bytes (``check_steps`` fits it at the smallest W); ``fused``: the run's clients read what
    they add to in one call (``_cost_counts.fused_reads``)."""
    w, strategy = row["world_size"], row["strategy"]
    f = (ref["forward_ms"] + ref["backward_ms"]) / 1e3  # one thread alone: its wall is its CPU
    o = ref["optimizer_ms"] / 1e3
    opt_total, opt_path = (w * o, o) if strategy == "ddp" else (o, o / w)
    counts = {
        "ours": ours_counts(strategy, psi, w, units, chunk, fused),
        "torch": gloo_counts(strategy, psi, w, units),
    }
    out = {}
    for side, (msgs, handled) in counts.items():
        c = costs["ours" if side == "ours" else "gloo"]
        comm = cc.cpu_s(c, msgs, handled)
        more = (extra or {}).get(side, 0.0)
        cpu = w * (f + comm + more) + opt_total
        out[f"{side}_cpu_s"] = cpu
        out[f"{side}_comm_cpu_s"] = w * comm
        out[f"{side}_step_s"] = max(cpu / cores, f + opt_path + more)
    return out


def overhead_where(row: dict[str, Any], ref: dict[str, Any], comm_s: float, side: str) -> dict:
    """A rank's CPU a step beyond the compute alone and its counted messages and bytes, split
    by where it was spent (a scale run with ``rank_threads_cpu_s``; else empty):

    - ``training_thread_s``: the training thread's CPU less the compute it would do alone (F,
      and the AdamW step over what the rank steps: all of it for DDP, 1/W for torch's ZeRO and
      FSDP2, none for ours' sharded strategies, whose servers step);
    - ``beside_s``: the rank's other threads and (ours) its share of the servers' CPU, less
      its counted communication and (ours' sharded strategies) its share of the AdamW step.
    """
    threads = row.get(f"{side}_rank_threads_cpu_s")
    if not threads or "main" not in threads:
        return {}
    w, strategy = row["world_size"], row["strategy"]
    f = (ref["forward_ms"] + ref["backward_ms"]) / 1e3
    o = ref["optimizer_ms"] / 1e3
    sharded = strategy != "ddp"
    on_rank = 0.0 if side == "ours" and sharded else o / w if sharded else o
    servers = (row.get(f"{side}_cpu_per_step_s") or {}).get("servers", 0.0) / w
    on_servers = o / w if side == "ours" and sharded else 0.0
    beside = sum(threads.values()) - threads["main"] + servers
    return {
        "training_thread_s": round(threads["main"] - f - on_rank, 3),
        "beside_s": round(beside - comm_s - on_servers, 3),
    }


def _side(measured_ms: float, measured_cpu: float, p: dict[str, float], side: str) -> dict:
    step, cpu = p[f"{side}_step_s"] * 1e3, p[f"{side}_cpu_s"]
    return {
        "predicted_ms": round(step, 1),
        "error": round(step / measured_ms - 1, 3),
        "predicted_cpu_s": round(cpu, 2),
        "cpu_error": round(cpu / measured_cpu - 1, 3) if measured_cpu else None,
    }


def _within(rows: list[dict[str, Any]], side: str, kind: str, key: str) -> int:
    return sum(
        r[side][kind][key] is not None and abs(r[side][kind][key]) <= WITHIN
        for r in rows
        if kind == "alone" or not r[side]["fitted"]
    )


def check_steps(doc: dict[str, Any], costs: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Every cell of a scale run with both sides measured and its model's compute alone,
    predicted three ways against its measured step (ms) and CPU a step (s):

    - ``alone``: from the compute alone and the counted messages and bytes only;
    - ``fitted_overhead``: plus a CPU overhead a rank and step (``overhead_s_per_rank``)
      fitted for each model, strategy and side on its cell of the smallest W (the rest of that
      cell's CPU): what the strategy spends beyond the counts (hooks, flattening, its client's
      threads; the servers' staging). The cells of larger W are held out: the check of how
      the counts grow with W.
    - ``in_step``: the counts at a message's and a byte's cost inside a step, one factor a
      model and side over the isolated costs, fitted on every strategy's cell of the smallest
      W (``in_step_factors``; ``in_step_factor`` in the result); the same cells held out.

    Within 20% counted per side: ``alone`` over every cell, the two fits over the held-out."""
    refs = doc.get("compute_reference") or {}
    cores = int((doc.get("machine") or {}).get("cores") or 1)
    fused = cc.fused_reads(doc.get("client") or {})
    cells, why_not = [], []
    for r in doc.get("results") or []:
        beside = r.get("compute_beside") or {}
        ref = beside if "optimizer_ms" in beside else refs.get(r["model"]) or {}
        if "optimizer_ms" not in ref or "ours_ms" not in r or "torch_ms" not in r:
            why_not.append(f"{r['model']} W={r['world_size']} {r['strategy']}")
            continue
        model = doc["models"][r["model"]]
        chunk = cc.run_chunk(doc.get("client") or {}, r["world_size"], "chunk_mib_by_world")
        args = (ref, costs, model["n_params"], units_of(model.get("config") or {}), chunk, cores)
        measured = {s: sum((r.get(f"{s}_cpu_per_step_s") or {}).values()) for s in SIDES}
        cells.append((r, args, measured, predict_cell(r, *args, fused=fused)))
    smallest: dict[tuple[str, str], int] = {}  # (model, strategy): the W its overhead is fitted at
    for r, *_ in cells:
        key = (r["model"], r["strategy"])
        smallest[key] = min(smallest.get(key, r["world_size"]), r["world_size"])
    factors = in_step_factors(cells, smallest)
    extra: dict[tuple[str, str], dict[str, float]] = {}
    for r, _, measured, p in cells:
        key, w = (r["model"], r["strategy"]), r["world_size"]
        if w == smallest[key]:
            extra[key] = {s: (measured[s] - p[f"{s}_cpu_s"]) / w if measured[s] else 0.0
                          for s in SIDES}  # fmt: skip
    rows = []
    for r, args, measured, alone in cells:
        key = (r["model"], r["strategy"])
        more = extra[key]
        fitted = predict_cell(r, *args, extra=more, fused=fused)
        ref, _, *rest = args
        in_step = predict_cell(r, ref, scaled(costs, factors[r["model"]]), *rest, fused=fused)
        out: dict[str, Any] = {k: r[k] for k in ("model", "world_size", "strategy")}
        out["compute"] = "beside" if args[0] is r.get("compute_beside") else "run"
        for s in SIDES:
            out[s] = {
                "measured_ms": r[f"{s}_ms"],
                "measured_cpu_s": round(measured[s], 2),
                "comm_cpu_s": round(alone[f"{s}_comm_cpu_s"], 2),
                "overhead_s_per_rank": round(more[s], 3),
                "fitted": r["world_size"] == smallest[key],
                "alone": _side(r[f"{s}_ms"], measured[s], alone, s),
                "fitted_overhead": _side(r[f"{s}_ms"], measured[s], fitted, s),
                "in_step": _side(r[f"{s}_ms"], measured[s], in_step, s),
                "overhead_where": overhead_where(
                    r, args[0], alone[f"{s}_comm_cpu_s"] / r["world_size"], s
                ),
            }
        rows.append(out)
    return {
        "rows": rows,
        "cells": len(rows),
        "held_out": sum(not r["ours"]["fitted"] for r in rows),
        "alone_within_20pct": {
            s: {"step": _within(rows, s, "alone", "error"),
                "cpu": _within(rows, s, "alone", "cpu_error")} for s in SIDES
        },
        "held_out_within_20pct": {
            s: {"step": _within(rows, s, "fitted_overhead", "error"),
                "cpu": _within(rows, s, "fitted_overhead", "cpu_error")} for s in SIDES
        },
        "in_step_factor": {m: {s: round(k, 3) for s, k in f.items()} for m, f in factors.items()},
        "in_step_held_out_within_20pct": {
            s: {"step": _within(rows, s, "in_step", "error"),
                "cpu": _within(rows, s, "in_step", "cpu_error")} for s in SIDES
        },
        "cores": cores,
        "not_checked": why_not,
    }  # fmt: skip


def in_step_factors(cells: list[tuple], smallest: dict[tuple[str, str], int]) -> dict:
    """What a message and a byte cost inside a training step, as a multiple of what they cost
    in an isolated collective (``fit_host``): for each model and side, one factor fitted by
    least squares over the cells of every strategy at the smallest W, to the CPU each
    measured beyond its compute alone (the residual's share of the counted communication).
    A step's collectives run beside the compute, their chunks no longer in cache; one factor
    a side, where the fitted overhead takes one a strategy."""
    sums: dict[str, dict[str, list[float]]] = {}
    for r, _, measured, p in cells:
        if r["world_size"] != smallest[(r["model"], r["strategy"])]:
            continue
        for s in SIDES:
            comm = p[f"{s}_comm_cpu_s"]
            if measured[s] and comm > 0:
                got = measured[s] - (p[f"{s}_cpu_s"] - comm)  # the CPU beyond the compute
                acc = sums.setdefault(r["model"], {}).setdefault(s, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + comm * got, acc[1] + comm * comm
    return {
        m: {s: (acc[s][0] / acc[s][1] if s in acc else 1.0) for s in SIDES}
        for m, acc in ((r["model"], sums.get(r["model"], {})) for r, *_ in cells)
    }


def scaled(costs: dict[str, dict[str, float]], factor: dict[str, float]) -> dict:
    """``costs`` with each side's message and byte costs multiplied by its ``factor``."""
    return {
        key: {k: v * factor["ours" if key == "ours" else "torch"] for k, v in c.items()}
        for key, c in costs.items()
    }


def check_host(colls: list[dict[str, Any]], costs: dict[str, dict[str, float]]) -> dict:
    """The collectives runs' rows on one host that the fit did not use (W > 2): each op's CPU
    a rank (and its share of the servers) predicted from its counts, against the measured."""
    rows, within = [], {"ours": 0, "gloo": 0}
    for run, coll in enumerate(colls, 1):
        client = coll.get("client") or {}
        fused = cc.fused_reads(client)
        for r in coll.get("results") or []:
            w = r["world_size"]
            if w == 2 or "ours_sep_cpu_ms_per_rank" not in r:
                continue
            chunk = cc.run_chunk(client, w, "chunk_mib_same_host")
            nbytes = tensor_bytes(r)
            out: dict[str, Any] = {"run": run, "op": r["op"], "world_size": w}
            out["bytes"] = round(nbytes)
            for side, key in (("ours", "ours_sep"), ("gloo", "gloo")):
                msgs, handled, _ = cc.op_counts(side, r["op"], nbytes, w, chunk, fused)
                pred = cc.cpu_s(costs[side], msgs, handled) * 1e3
                err = pred / max(r[f"{key}_cpu_ms_per_rank"], 1e-6) - 1
                out[side] = {
                    "measured_cpu_ms": r[f"{key}_cpu_ms_per_rank"],
                    "predicted_cpu_ms": round(pred, 3),
                    "cpu_error": round(err, 3),
                }
                within[side] += abs(err) <= WITHIN
            rows.append(out)
    return {"rows": rows, "cells": len(rows), "cpu_within_20pct": within}


def markdown(result: dict[str, Any]) -> list[str]:
    """The same-host costs, the held-out same-host cells and ``check_steps``' table: each
    cell's measured and predicted step and CPU, both sides."""
    steps, host, held = result["steps"], result["costs_same_host"], result["check_same_host"]
    if isinstance(steps, str):
        return [f"\nSteps not checked: {steps}."]
    lines = ["\nBetween processes of one host (fitted at W = 2): " + "; ".join(
        f"{side} {c['cpu_s_per_message'] * 1e3:.3f} ms a message,"
        f" {c['cpu_s_per_byte'] * 1e9:.3f} ns a byte" for side, c in host.items()
    ) + f". Held-out cells (W > 2) within 20%, CPU: {held['cpu_within_20pct']} of"
        f" {held['cells']}."]  # fmt: skip
    beside = sum(r["compute"] == "beside" for r in steps["rows"])
    lines += [
        f"\nTraining steps on one host ({steps['cores']} cores; the compute alone measured"
        f" beside the cell in {beside} of {steps['cells']}, else once a run), within 20%"
        f" (step, CPU): from"
        f" the compute alone {_pairs(steps['alone_within_20pct'])} of {steps['cells']}; with"
        f" the overhead fitted at the smallest W {_pairs(steps['held_out_within_20pct'])} of"
        f" {steps['held_out']} held out; with in-step costs ({_factors(steps)}, fitted at the"
        f" smallest W) {_pairs(steps['in_step_held_out_within_20pct'])} of the same\n",
        "| cell | side | step | from compute alone | with the overhead | CPU a step | from"
        " compute alone | with the overhead | of it messages and bytes | overhead a rank |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in steps["rows"]:
        for side in SIDES:
            x = r[side]
            a, f = x["alone"], x["fitted_overhead"]
            fit = (
                "fitted" if x["fitted"] else f"{f['predicted_ms'] / 1e3:.2f} s ({f['error']:+.0%})"
            )
            fit_cpu = "fitted" if x["fitted"] else f"{f['predicted_cpu_s']:.2f} s ({_pct(f)})"
            lines.append(
                f"| {r['model']} W={r['world_size']} {r['strategy']} | {side}"
                f" | {x['measured_ms'] / 1e3:.2f} s | {a['predicted_ms'] / 1e3:.2f} s"
                f" ({a['error']:+.0%}) | {fit} | {x['measured_cpu_s']:.2f} s"
                f" | {a['predicted_cpu_s']:.2f} s ({_pct(a)}) | {fit_cpu}"
                f" | {x['comm_cpu_s']:.2f} s | {x['overhead_s_per_rank']:.2f} s{_where(x)} |"
            )
    if steps["not_checked"]:
        lines.append("\nNot checked (a side or the compute alone missing): "
                     + ", ".join(steps["not_checked"]))  # fmt: skip
    return lines


def _factors(steps: dict[str, Any]) -> str:
    """``ours 1.62x, torch 1.07x`` (each model's, where a run has several)."""
    return "; ".join(
        ", ".join(f"{s} {k:.2f}x" for s, k in f.items()) for f in steps["in_step_factor"].values()
    )


def _where(x: dict[str, Any]) -> str:
    where = x.get("overhead_where")
    if not where:
        return ""
    return f" ({where['training_thread_s']:+.2f} training thread, {where['beside_s']:+.2f} beside)"


def _pct(pred: dict[str, Any]) -> str:
    return "–" if pred["cpu_error"] is None else f"{pred['cpu_error']:+.0%}"


def _pairs(counts: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{s} {c['step']} and {c['cpu']}" for s, c in counts.items())
