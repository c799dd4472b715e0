"""What rank-order reduction costs: time and server memory, against arrival-order sums.

    python -m benchmarks.determinism [--sizes 16,64] [--world-sizes 3,4] [--reps 7]

``ShardingConfiguration(deterministic=True)`` (the default) makes the servers add
contributions in rank order whatever order they arrive in: a contribution of more than 1 MiB
that arrives before its predecessors waits for its turn holding its own request, a smaller one
(or one past the bounds on waiting, server/runtime/turns.py) as a copy until they are in
(server/buffers/contributions.py, server/collectives/slots.py). This
measures, in one run and one process, for each world size W and size S:

- **all_reduce**: W ranks (threads, one ShardClient each) all-reduce an S MiB float32 tensor
  through W in-process servers, ``ShardClient(deterministic=True)`` against ``False``;
- **push**: W ranks push an S MiB float32 gradient into a flat buffer registered on the W
  servers (SGD, lr 0, the step applied when the last contribution is in), with
  ``arrival_order=False`` against ``True``.

Each repetition is timed from a barrier to the slowest rank's end; we quote medians after one
warm-up. A sampler thread reads the servers' staging + accumulator bytes (slots: the bytes
held; buffers: ``grad_bytes``) every millisecond and reports the peak, beside the S x W bytes
of all contributions. The servers are called in process (no gRPC), so what differs is the
reduction alone. Prints one JSON document; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from paramshard.client import ClusterSpec, ShardClient, StepArgs
from paramshard.server import ShardServer

MiB = 2**20


class PeakBytes:
    """Polls ``measure()`` every millisecond while running; ``peak`` is the largest value."""

    def __init__(self, measure: Callable[[], int]) -> None:
        self.measure, self.peak = measure, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.measure())

    def __enter__(self) -> PeakBytes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def slot_bytes(servers: list[ShardServer]) -> int:
    return sum(s.servicer.slots.usage()[0] for s in servers)


def grad_bytes(servers: list[ShardServer]) -> int:
    total = 0
    for s in servers:
        for slices in s.servicer.buffers.jobs().values():
            total += sum(b.bytes_by_kind()[1] for b in slices)
    return total


def timed_reps(clients: list[ShardClient], reps: int, work: Callable[[ShardClient, int], Any]):
    """Seconds per repetition: all ranks start together, the slowest one ends it."""
    barrier = threading.Barrier(len(clients))
    times: list[float] = []

    def rank(c: ShardClient) -> None:
        for rep in range(reps):
            barrier.wait()
            began = time.perf_counter()
            work(c, rep)
            barrier.wait()
            if c.rank == 0:
                times.append(time.perf_counter() - began)

    with ThreadPoolExecutor(len(clients)) as pool:
        for f in [pool.submit(rank, c) for c in clients]:
            f.result()
    return times


def all_reduce_cell(servers: list[ShardServer], world: int, mib: int, reps: int, det: bool):
    spec = ClusterSpec([s.address for s in servers])
    run = f"ar-{world}-{mib}-{det}-{time.monotonic_ns()}"
    clients = [
        ShardClient(spec, r, world, run_id=run, deterministic=det, timeout_s=120)
        for r in range(world)
    ]
    data = [
        np.random.default_rng(r).standard_normal(mib * MiB // 4, np.float32) for r in range(world)
    ]
    try:
        with PeakBytes(lambda: slot_bytes(servers)) as peak:
            times = timed_reps(clients, reps + 1, lambda c, _: c.all_reduce(data[c.rank]))
    finally:
        for c in clients:
            c.close()
    return times[1:], peak.peak


def push_cell(servers: list[ShardServer], world: int, mib: int, reps: int, det: bool):
    spec = ClusterSpec([s.address for s in servers])
    job, numel = f"push-{world}-{mib}-{det}-{time.monotonic_ns()}", mib * MiB // 4
    clients = [ShardClient(spec, r, world, timeout_s=120) for r in range(world)]
    clients[0].register_buffer(job, "b", numel, hyper={"lr": 0.0}, arrival_order=not det)
    clients[0].set_params(job, "b", np.zeros(numel, np.float32))
    grads = [np.random.default_rng(r).standard_normal(numel, np.float32) for r in range(world)]
    args = StepArgs({"lr": 0.0})
    try:
        with PeakBytes(lambda: grad_bytes(servers)) as peak:
            times = timed_reps(
                clients,
                reps + 1,
                lambda c, step: c.push_grads(job, "b", grads[c.rank], step, step_args=args),
            )
        clients[0].drop_job(job)
    finally:
        for c in clients:
            c.close()
    return times[1:], peak.peak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,64", help="MiB per tensor, comma-separated")
    ap.add_argument("--world-sizes", default="3,4")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args(argv)
    rows = []
    for world in [int(w) for w in a.world_sizes.split(",")]:
        servers = [ShardServer("127.0.0.1", 0).start() for _ in range(world)]
        try:
            for mib in [int(s) for s in a.sizes.split(",")]:
                for op, cell in (("all_reduce", all_reduce_cell), ("push", push_cell)):
                    row: dict[str, Any] = {"op": op, "world": world, "mib": mib}
                    for det in (False, True, False, True):  # interleaved: same machine load
                        times, peak = cell(servers, world, mib, a.reps, det)
                        key = "rank_order" if det else "arrival_order"
                        row.setdefault(f"{key}_times_s", []).extend(times)
                        row[f"{key}_peak_mib"] = max(row.get(f"{key}_peak_mib", 0), peak / MiB)
                    for key in ("arrival_order", "rank_order"):
                        row[f"{key}_ms"] = 1e3 * statistics.median(row.pop(f"{key}_times_s"))
                    row["time_ratio"] = row["rank_order_ms"] / row["arrival_order_ms"]
                    row["contributions_mib"] = world * mib
                    print(json.dumps(row), file=sys.stderr)
                    rows.append(row)
        finally:
            for s in servers:
                s.stop(0)
    print(json.dumps({"benchmark": "determinism", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
