"""What ``benchmarks.scale`` makes of one side of a cell: its ranks' per-step rows
(benchmarks/_scale_ranks.py) reduced to the step time, where rank 0 spends it, the CPU a step
of all the processes and of a rank by kind of thread. Medians over the
steps after the warm-up (the module docstring of benchmarks/scale.py says what each holds).
"""

from __future__ import annotations

import statistics


def step_ms(ranks: list[dict], warmup: int) -> float:
    per_step = [max(r["steps"][i]["s"] for r in ranks) for i in range(len(ranks[0]["steps"]))]
    return round(statistics.median(per_step[warmup:]) * 1e3, 1)


def breakdown(rank0: dict, warmup: int) -> dict[str, float]:
    """Rank 0's median ms per step of each phase and communication kind (see the docstring)."""
    rows = rank0["steps"][warmup:]
    keys = {"forward", "backward", "optimizer", "server_step_s"} & set(rows[0])
    comm_keys = sorted({k for r in rows for k in r.get("comm", {})})

    def med(values: list[float]) -> float:
        return round(statistics.median(values) * 1e3, 1)

    out = {k.removesuffix("_s"): med([r[k] for r in rows]) for k in sorted(keys)}
    for k in sorted(rows[0].get("main_cpu", {})):  # the training thread's CPU in each phase
        out[f"main_cpu/{k}"] = med([r["main_cpu"][k] for r in rows])
    if "minor_faults" in rows[0]:  # thousands a step (not ms)
        out["minor_faults_k"] = round(statistics.median(r["minor_faults"] for r in rows) / 1e3)
    if "gc_s" in rows[0]:  # Python's garbage collector, every generation
        out["gc"] = med([sum(r["gc_s"].values()) for r in rows])
    for k in comm_keys:
        out[k] = med([r.get("comm", {}).get(k, 0.0) for r in rows])
    waits = [sum(v for k, v in r.get("comm", {}).items() if k.startswith("blocked/")) for r in rows]
    if comm_keys:
        out["blocked_total"] = med(waits)
        out["compute"] = med([r["s"] - b for r, b in zip(rows, waits, strict=True)])
    return out


def cpu_per_step(ranks: list[dict], warmup: int) -> dict[str, float]:
    """Median CPU seconds a step of all the ranks' processes together and (ours) of all the
    servers': on a machine with fewer cores than processes, where the time goes."""
    steps = range(warmup, len(ranks[0]["steps"]))
    out = {"trainers": statistics.median(sum(r["steps"][i]["cpu"] for r in ranks) for i in steps)}
    if "servers_cpu" in ranks[0]["steps"][0]:
        out["servers"] = statistics.median(ranks[0]["steps"][i]["servers_cpu"] for i in steps)
    return {k: round(v, 2) for k, v in out.items()}


def server_threads_cpu(ranks: list[dict], warmup: int) -> dict[str, float]:
    """All the servers' CPU seconds a step by kind of thread (the kernel's names,
    server/runtime/thread_names.py: ``session``, a session's calls; ``shard``, grpc's handlers
    of unary calls and of the sessions' replies; ``session-reader``; ``python``, grpc's
    poller and the main thread): medians over the timed steps, as rank 0 read them. Empty
    without servers."""
    rows = [s.get("servers_threads_cpu") for s in ranks[0]["steps"][warmup:]]
    if not rows or any(r is None for r in rows):
        return {}
    kinds = sorted({k for r in rows for k in r})
    return {k: round(statistics.median(r.get(k, 0.0) for r in rows), 3) for k in kinds}


def rank_threads_cpu(ranks: list[dict], warmup: int) -> dict[str, float]:
    """A rank's CPU seconds a step by kind of thread: the median over the timed steps of the
    mean over ranks (``threads_cpu``: _scale_ranks)."""
    rows = [[s["threads_cpu"] for s in r["steps"][warmup:]] for r in ranks]
    kinds = sorted({k for steps in rows for s in steps for k in s})

    def per_step(kind: str) -> list[float]:
        return [sum(s.get(kind, 0.0) for s in at) / len(ranks) for at in zip(*rows, strict=True)]

    return {k: round(statistics.median(per_step(k)), 3) for k in kinds}
