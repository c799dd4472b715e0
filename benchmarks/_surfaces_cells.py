"""The cells of ``benchmarks.surfaces``, each measured once (the module repeats them): a
training run with or without replicas, a snapshot of the trained job, its offline and live
exports, a restore onto more servers, and the torch reference of the same state.

Servers are ``paramshard serve`` processes started as ``paramshard launch`` starts local ones
(``start_local_servers``), all with one ``--snapshot-dir``, on loopback without tokens (which
``serve`` allows there: the admin calls, snapshot and restore, need no token then). They are
put in ``Child.registry``, so ``install_cleanup`` stops them too. Every command runs in a
child of its own (``_surfaces_children.cli_main``), bounded in time; every process is
stopped by PID before a cell returns or fails.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks._cpu import Load, proc_cpu_s
from benchmarks._processes import Child, child_env, logger, stop_all
from benchmarks._scale_memory import ServerSampler, loadavg
from benchmarks._scale_ranks import rss_kinds
from benchmarks._surfaces_children import reset_peak
from benchmarks._training import launch_ranks

SERVER_START_S = 120.0  # bound on starting a set of servers
COMMAND_S = 600.0  # bound on one snapshot, export or restore (GPT-2 124M: seconds here)
log = logger("surfaces")


def start_servers(n: int, snapshot_dir: str) -> tuple[list[Any], list[str]]:
    """n ``paramshard serve --snapshot-dir DIR`` on 127.0.0.1; (children, addresses)."""
    from paramshard.local_servers import start_local_servers

    kids, addresses = start_local_servers(
        n, "cpu", child_env(tuned=True), SERVER_START_S, ("--snapshot-dir", snapshot_dir)
    )
    Child.registry.extend(kids)  # stopped by install_cleanup's stop_all too
    return kids, addresses


def pids(servers: list[Any]) -> list[int]:
    return [k.proc.pid for k in servers]


# ================================================================================ training
def train(
    model: str, world: int, steps: int, replicate_every: int, step_budget: float, snapshot_dir: str
) -> dict[str, Any]:
    """One training run on fresh servers; returns the ranks' results, each server's memory
    (idle before the ranks, VmHWM after, RssAnon and RssShmem peaks sampled every 0.1 s), and
    the servers themselves, still running, with the job (the caller stops them)."""
    servers, addresses = start_servers(world, snapshot_dir)
    try:
        time.sleep(1.0)  # a server's imports settle
        idle = [rss_kinds(p)["VmRSS"] for p in pids(servers)]
        run = f"s{uuid.uuid4().hex[:10]}"
        job = f"surfaces-{'rep' if replicate_every else 'plain'}-{run}"
        argv = ["--model", model, "--world", str(world), "--steps", str(steps)]
        argv += ["--servers", ",".join(addresses), "--run", run, "--job", job]
        argv += ["--replicate-every", str(replicate_every)]
        label = f"replicas-{replicate_every}"
        began, load = time.monotonic(), loadavg()
        servers_cpu = sum(proc_cpu_s(p) for p in pids(servers))
        with ServerSampler(pids(servers)) as sampled, Load() as busy:
            ranks = launch_ranks(
                "benchmarks.surfaces", "_rank", label, world, argv, 180.0 + steps * step_budget,
                tuned=False, hosted_servers=False, send_exit=True, log=log, watch=servers,
            )  # fmt: skip
            servers_cpu = sum(proc_cpu_s(p) for p in pids(servers)) - servers_cpu
        wall = time.monotonic() - began
        hwm = [rss_kinds(p)["VmHWM"] for p in pids(servers)]
    except BaseException:
        stop_all(servers)
        raise
    return {
        "job": job,
        "servers": servers,
        "addresses": addresses,
        "ranks": ranks,
        "wall_s": round(wall, 1),
        "loadavg_at_start": load,
        # Load counts the servers (running, not reaped) as others: their CPU is taken out
        "foreign_cpu_frac": round(
            max(0.0, busy.foreign - servers_cpu / (wall * (os.cpu_count() or 1))), 3
        ),
        "server_idle_rss_bytes": idle,
        "server_peak_rss_bytes": hwm,
        "server_peak_anon_bytes": sampled.anon,
        "server_peak_shmem_bytes": sampled.shmem,
    }


# ================================================================================ commands
def command(label: str, args: list[str], timeout: float = COMMAND_S) -> dict[str, Any]:
    """``paramshard *args`` in a child of its own (``cli_main``); its RESULT, or an error when
    it failed or took longer than ``timeout`` s."""
    kid = Child.module(
        label,
        "benchmarks.surfaces",
        ["_cli", "--command", json.dumps(args)],
        child_env(tuned=False),
        timeout + 60,
    )
    try:
        got = json.loads(kid.expect("RESULT", timeout))
    finally:
        stop_all([kid])
    if got["rc"] != 0:
        raise RuntimeError(f"paramshard {' '.join(args)} exited with {got['rc']}")
    return got


def _rise(got: dict[str, Any]) -> dict[str, Any]:
    """A command's (or the reference's) seconds, peak resident memory and its rise."""
    return {
        "wall_s": round(got["wall_s"], 3),
        "peak_rss_mb": round(got["peak_bytes"] / 2**20, 1),
        "rss_rise_mb": round((got["peak_bytes"] - got["rss_before_bytes"]) / 2**20, 1),
    }


def snapshot(job: str, tag: str, servers: list[Any], addresses: list[str], folder: str) -> dict:
    """``paramshard snapshot JOB --tag TAG``: seconds, each server's resident memory rise
    while it ran (its peak reset just before: ``reset_peak``), the shards' bytes."""
    before = []
    for p in pids(servers):
        before.append(rss_kinds(p)["VmRSS"])
        reset_peak(p)
    got = command("snapshot", ["snapshot", job, "--tag", tag, "--servers", ",".join(addresses)])
    rises = [rss_kinds(p)["VmHWM"] - b for p, b in zip(pids(servers), before, strict=True)]
    files = sorted((Path(folder) / job / tag).glob("shard-*"))
    return {
        "wall_s": round(got["wall_s"], 3),
        "server_rss_rise_mb": [round(r / 2**20, 1) for r in rises],
        "shards": len(files),
        "shard_bytes": sum(f.stat().st_size for f in files),
    }


def exports(job: str, tag: str, addresses: list[str], folder: str, out_dir: str) -> dict:
    """Offline export of the snapshot and live export from the servers, each into its own
    file: seconds, the exporting process's peak resident memory and its rise; whether the two
    files hold the same tensors (the job did not move between them)."""
    offline = os.path.join(out_dir, "offline.safetensors")
    live = os.path.join(out_dir, "live.safetensors")
    snap = str(Path(folder) / job / tag)
    res = {"offline": _rise(command("export", ["export", "--snapshot", snap, "--out", offline]))}
    servers = ["--servers", ",".join(addresses)]
    res["live"] = _rise(command("export-live", ["export", job, "--out", live, *servers]))
    res["file_bytes"] = os.path.getsize(live)
    res["largest_tensor_mb"] = round(largest_tensor_bytes(live) / 2**20, 1)
    res["same_tensors"] = same_tensors(offline, live)
    for f in (offline, live):
        os.remove(f)
    return res


def largest_tensor_bytes(path: str) -> int:
    """The largest tensor's bytes in a safetensors file, from its header: what an export that
    streams one tensor at a time holds at least."""
    import struct

    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return max(end - begin for k, v in header.items() if k != "__metadata__"
               for begin, end in [v["data_offsets"]])  # fmt: skip


def same_tensors(a: str, b: str) -> bool:
    """Whether two safetensors files hold the same names, dtypes, shapes and bytes (their
    metadata may differ), read a tensor at a time."""
    from safetensors import safe_open

    with safe_open(a, "numpy") as fa, safe_open(b, "numpy") as fb:
        if sorted(fa.keys()) != sorted(fb.keys()):
            return False
        for name in fa.keys():
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                return False
    return True


def restore(job: str, tag: str, n: int, contributors: int, folder: str) -> dict[str, Any]:
    """``paramshard restore JOB --tag TAG --contributors C`` onto n fresh servers: seconds, and
    each new server's resident memory idle before and at its peak after."""
    servers, addresses = start_servers(n, folder)
    try:
        time.sleep(1.0)
        idle = [rss_kinds(p)["VmRSS"] for p in pids(servers)]
        args = ["restore", job, "--tag", tag, "--contributors", str(contributors)]
        got = command("restore", [*args, "--servers", ",".join(addresses)])
        peaks = [rss_kinds(p)["VmHWM"] for p in pids(servers)]
    finally:
        stop_all(servers)
    return {
        "wall_s": round(got["wall_s"], 3),
        "server_idle_rss_mb": [round(x / 2**20, 1) for x in idle],
        "server_peak_rss_mb": [round(x / 2**20, 1) for x in peaks],
    }


def reference(model: str, out_dir: str) -> dict[str, Any]:
    """torch.save, then torch.load of its file, then save_file of the same state, each in a
    process of its own (``reference_main``)."""
    out: dict[str, Any] = {}
    for op in ("torch_save", "torch_load", "save_file"):
        kid = Child.module(
            f"reference-{op}",
            "benchmarks.surfaces",
            ["_reference", "--op", op, "--model", model, "--dir", out_dir],
            child_env(tuned=False),
            COMMAND_S + 60,
        )
        try:
            got = json.loads(kid.expect("RESULT", COMMAND_S))
        finally:
            stop_all([kid])
        out[op] = _rise(got)
        if "file_bytes" in got:
            out[op]["file_bytes"] = got["file_bytes"]
        if "n_params" in got:
            out["n_params"] = got["n_params"]
    return out
