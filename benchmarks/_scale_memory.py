"""The machine and memory side of ``benchmarks.scale``: what the machine is (CPU, its vector
units, memory, load, the commit measured), the resident memory of a bare trainer and an idle
server, a cell's memory estimate (checked against MemAvailable before it runs) and each
side's peak resident memory against the formula (``_scale_models.formula``)."""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from typing import Any

from benchmarks._processes import ROOT, Child, serve_processes, stop_all
from benchmarks._scale_models import activation_bytes, formula
from benchmarks._scale_ranks import gathered_units_bytes, rss_bytes, rss_kinds

GiB = 2**30
TRANSIENT = 256 * 2**20  # buffers in flight per process (buckets, segments, staged chunks)


# ================================================================================ machine
def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cores": os.cpu_count(), "python": platform.python_version()}
    with open("/proc/cpuinfo") as f:
        text = f.read()
    for line in text.splitlines():
        if line.startswith("model name"):
            info["cpu"] = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            info["simd"] = sorted(
                f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
            )
            break
    info["mem_total_gib"] = round(meminfo("MemTotal") / GiB, 1)
    info["git"] = git_state()
    import torch

    info["torch"] = torch.__version__
    return info


def git_state() -> str:
    """The commit measured, with "+changes" when the work tree differs from it."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False
        ).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (
        "+changes" if git("status", "--porcelain", "-uno") else ""
    )


def meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def write_report(out: dict[str, Any]) -> None:
    """A benchmark's JSON to stdout, with the load average at its end beside ``machine()``'s."""
    out["machine"]["loadavg_at_end"] = loadavg()
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


# ================================================================================ memory
def process_overhead(lifetime: float) -> dict[str, int]:
    """Resident bytes of a bare trainer (imports, no model) and of an idle server."""
    kid = Child.module("overhead", "benchmarks.scale", ["_overhead"], os.environ.copy(), lifetime)
    try:
        trainer = json.loads(kid.expect("RESULT", 120))["rss_bytes"]
    finally:
        stop_all([kid])
    servers, _ = serve_processes(1, 120)
    try:
        time.sleep(1.0)
        server = rss_bytes(servers[0].proc.pid)[0]
    finally:
        stop_all(servers)
    return {"trainer": trainer, "server": server}


def estimate(model: str, strategy: str, side: str, psi: int, w: int, over: dict) -> int:
    """Bytes a cell needs at most: per trainer overhead + the larger of the model as built (4Ψ,
    every rank builds it whole) and its formula + activations + transients, and for our ZeRO-2
    4Ψ more (its formula counts the parameters only, but the backward makes a gradient for
    every parameter before the buckets push them: without this term GPT-2 355M ZeRO-2 at W=4
    was estimated to fit in 20.4 GiB and the kernel's OOM killer killed a rank, whose trainers
    held 4.1 GB each), and for our ZeRO-1 4Ψ more (the flat its gradients are pushed from);
    per server overhead + 1.5 x formula (optimizer temporaries, staged
    contributions) + transients."""
    units = gathered_units_from_shape(model, psi)
    f = formula(strategy, side, psi, w, units)
    grads = 4 * psi if side == "ours" and strategy in ("zero1", "zero2") else 0
    trainer = over["trainer"] + max(4 * psi, f["trainer"]) + grads
    trainer += activation_bytes(model) + TRANSIENT
    servers = over["server"] + int(1.5 * f["server"]) + TRANSIENT if side == "ours" else 0
    return w * (trainer + servers)


def gathered_units_from_shape(model: str, psi: int) -> int:
    import torch

    from benchmarks._scale_models import build

    with torch.device("meta"):
        return gathered_units_bytes(build(model), psi)


def param_count(model: str) -> int:
    import torch

    from benchmarks._scale_models import build

    with torch.device("meta"):
        net = build(model)
    return sum(p.numel() for p in set(net.parameters()))


class ServerSampler:
    """Each server's own memory (RssAnon) and shared segments it maps (RssShmem) at their
    peaks, sampled every ``period`` seconds while the ranks run: VmHWM alone counts a segment
    in both the trainer and the server mapping it, though it is one copy of the bytes."""

    def __init__(self, pids: list[int], period: float = 0.1) -> None:
        self.pids, self.period = pids, period
        self.anon = [0] * len(pids)
        self.shmem = [0] * len(pids)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-rss", daemon=True)

    def __enter__(self) -> ServerSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for i, pid in enumerate(self.pids):
                try:
                    kinds = rss_kinds(pid)
                except OSError:  # it exited: its last sample stands
                    continue
                self.anon[i] = max(self.anon[i], kinds.get("RssAnon", 0))
                self.shmem[i] = max(self.shmem[i], kinds.get("RssShmem", 0))


def memory(side: dict, strategy: str, which: str, psi: int, w: int, over: dict, units: int):
    f = formula(strategy, which, psi, w, units)
    out: dict[str, Any] = {
        "trainer_peak_rss_mb": [round(r["peak_rss_bytes"] / 2**20) for r in side["ranks"]],
        "trainer_formula_mb": round((f["trainer"] + over["trainer"]) / 2**20),
    }
    r0 = side["ranks"][0]
    out["rank0_peak_mb_after"] = {
        "build": r0.get("peak_after_build_mb"),
        "setup": r0.get("peak_after_setup_mb"),
        "steps": [row["peak_rss_mb"] for row in r0["steps"]],
    }
    peak = max(r["peak_rss_bytes"] for r in side["ranks"])
    out["trainer_ratio_to_formula"] = round(peak / (f["trainer"] + over["trainer"]), 2)
    if which == "ours" and f["server"]:
        peaks = side["server_peak_rss_bytes"]
        out["server_peak_rss_mb"] = [round(p / 2**20) for p in peaks]
        out["server_formula_mb"] = round((f["server"] + over["server"]) / 2**20)
        out["server_ratio_to_formula"] = round(max(peaks) / (f["server"] + over["server"]), 2)
        if "server_peak_anon_bytes" in side:  # sampled (ServerSampler)
            own = side["server_peak_anon_bytes"]
            out["server_peak_own_mb"] = [round(p / 2**20) for p in own]
            out["server_own_ratio_to_formula"] = round(max(own) / (f["server"] + over["server"]), 2)
            out["server_peak_shmem_mb"] = [
                round(p / 2**20) for p in side["server_peak_shmem_bytes"]
            ]
        out["server_shmem_at_end_mb"] = [
            round(r.get("RssShmem", 0) / 2**20) for r in side["server_rss_at_end"]
        ]
    if "rss_at_end" in side["ranks"][0]:
        out["trainer_shmem_at_end_mb"] = [
            round(r["rss_at_end"].get("RssShmem", 0) / 2**20) for r in side["ranks"]
        ]
    return out
