"""How long a dead shard server takes to come back, for a model of a given size.

    python -m benchmarks.recovery [--mb 100] [--servers 2] [--reps 3]

Starts real ``paramshard serve`` processes (shared snapshot directory), registers an Adam job
of ``--mb`` MB of fp32 parameters, runs two steps (so the optimizer state exists), turns on
neighbour replication (k=1) and takes a snapshot. Then, per repetition, SIGKILLs server 1,
restarts it at the same address and times:
- ``replica``: bringing every server back to one version from the neighbour replicas
  (client.tools.recover_from_replicas),
- ``snapshot``: restoring the snapshot into all servers (client.tools.restore),
each from the restarted server answering to the job being usable again, plus the server's own
restart time. The reference measured in the same run is a raw copy of the same bytes
(``bytes(bytearray(n))``-style memcpy through numpy) to put the seconds in proportion.
Prints JSON; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._processes import free_port

ROOT = Path(__file__).resolve().parent.parent


def _serve(port: int, snapshots: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paramshard",
            "serve",
            "--port",
            str(port),
            "--snapshot-dir",
            snapshots,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "listening on" in line:
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"server on port {port} did not start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=100.0, help="model size in MB of fp32")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    opts = parser.parse_args(argv)

    from paramshard.client import ClusterSpec, ShardClient, StepArgs, tools

    numel = int(opts.mb * 1e6 / 4)
    snapshots = tempfile.mkdtemp(prefix="paramshard-recovery-")
    ports = [free_port() for _ in range(opts.servers)]
    procs = [_serve(p, snapshots) for p in ports]
    client = ShardClient(ClusterSpec([f"127.0.0.1:{p}" for p in ports]), timeout_s=300)
    results: dict[str, list[float]] = {"replica_s": [], "snapshot_s": [], "server_restart_s": []}
    try:
        job, hyper = "bench", {"lr": 1e-3}
        client.register_buffer(job, "b", numel, optimizer="adam", hyper=hyper, contributors=1)
        rng = np.random.default_rng(0)
        client.set_params(job, "b", rng.standard_normal(numel, dtype=np.float32))
        grad = rng.standard_normal(numel, dtype=np.float32)
        for step in range(2):
            client.push_grads(job, "b", grad, step)
            client.step(job, step, {"b": StepArgs(hyper)})
        tools.configure_replication(client, job, every=1)
        tools.snapshot(client, job, "bench")
        time.sleep(2.0)  # let the replicas of the current version reach the neighbours
        began = time.perf_counter()
        copy = np.array(grad, copy=True)  # the reference: one memcpy of the model's bytes
        memcpy_s = time.perf_counter() - began
        del copy
        for rep in range(opts.reps):
            for mode in ("replica", "snapshot"):
                procs[1].send_signal(signal.SIGKILL)
                procs[1].wait(timeout=30)
                began = time.perf_counter()
                procs[1] = _serve(ports[1], snapshots)
                results["server_restart_s"].append(time.perf_counter() - began)
                began = time.perf_counter()
                if mode == "replica":
                    tools.recover_from_replicas(client, job)
                    tools.configure_replication(client, job, every=1)
                else:
                    tools.restore(client, job, "bench")
                results[f"{mode}_s"].append(time.perf_counter() - began)
                print(f"rep {rep} {mode}: {results[f'{mode}_s'][-1]:.2f} s", file=sys.stderr)
                if mode == "replica":
                    time.sleep(2.0)  # the fresh replica of the restored version travels
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    report = {
        "benchmark": "recovery",
        "model_mb": opts.mb,
        "servers": opts.servers,
        "optimizer": "adam (params + 2 moments per slice)",
        "cpus": os.cpu_count(),
        "median_replica_recovery_s": statistics.median(results["replica_s"]),
        "median_snapshot_restore_s": statistics.median(results["snapshot_s"]),
        "median_server_restart_s": statistics.median(results["server_restart_s"]),
        "reference_memcpy_of_model_s": memcpy_s,
        "goal_s": 5.0,
        "runs": results,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
