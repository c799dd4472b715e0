"""All-reduces of more ranks than a server has threads for waiting calls
(``python -m benchmarks.leases --reads``).

Every rank's read of an all-reduce's slot waits on the server until the last contribution is
in, and a waiting call may hold a thread only within the admission gate's bounds: 112 by
default, 56 for one token (server/rpc/admission.py). Here W ranks, each a thread of this
process with its own client and the same token (as a job's ranks share one) and one
``ClusterSpec`` (one channel: ranks in processes of their own would have one each), all-reduce 16
floats through one in-process server, round after round, a barrier between rounds. Three
servers, one after another:

- ``default``: the default bounds. A server takes at most ``--max-sessions`` (64) sessions;
  ranks past them send one call a message, and their reads past the gate are refused "retry
  later" and asked again after pauses.
- ``session_each``: ``--max-sessions`` 2 W, so every rank has a session: reads past the gate
  wait in the server's line (server/transport/waiting_line.py).
- ``thread_each`` (the reference): as ``session_each`` with ``--workers`` 8 W, threads for
  every read, so the gate never holds one back.

Each reports the slowest rank's all-reduce, median and largest over the rounds after the
first; ``ratio``: ``session_each`` over ``thread_each``, medians.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import numpy as np

from paramshard.client import ClusterSpec, ShardClient
from paramshard.server import ShardServer

__all__ = ["reads_row"]

TOKEN = "bench-team"
NUMEL = 16
WAIT_S = 120.0
"""How long the benchmark waits for every rank's rounds: past it, the row reports an error."""


def _rounds(world: int, rounds: int, **bounds: Any) -> dict[str, Any]:
    """``rounds`` all-reduces of ``world`` ranks through a server with ``bounds``."""
    slowest = [0.0] * rounds
    errors: list[str] = []
    lock = threading.Lock()
    with ShardServer(tokens={TOKEN: "train"}, **bounds) as server:
        spec = ClusterSpec([server.address], token=TOKEN)
        clients = [
            ShardClient(spec, rank=r, world_size=world, run_id="reads", timeout_s=60)
            for r in range(world)
        ]
        barrier = threading.Barrier(world)
        expected = float(sum(range(world)))

        def rank(r: int) -> None:
            x = np.full(NUMEL, float(r), np.float32)
            try:
                for k in range(rounds):
                    barrier.wait(timeout=WAIT_S)
                    began = time.perf_counter()
                    y = clients[r].all_reduce(x)
                    took = time.perf_counter() - began
                    if not np.all(y == expected):
                        raise AssertionError(f"rank {r} round {k}: {y[0]} != {expected}")
                    with lock:
                        slowest[k] = max(slowest[k], took)
            except Exception as exc:  # noqa: BLE001 - reported in the row
                with lock:
                    errors.append(f"{type(exc).__name__}: {str(exc)[:120]}")
                barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
        began = time.monotonic()
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(max(0.0, began + WAIT_S - time.monotonic()))
            if any(t.is_alive() for t in threads):
                errors.append("ranks still running after the benchmark's wait")
        finally:
            for c in clients:
                c.close()
    timed = slowest[1:] or slowest
    return {
        "median_s": round(statistics.median(timed), 3),
        "max_s": round(max(timed), 3),
        "errors": sorted(set(errors)),
    }


def reads_row(world: int, rounds: int = 6) -> dict[str, Any]:
    """The three servers' rounds for ``world`` ranks, and the ratio."""
    sessions = {"max_sessions": 2 * world}
    row = {
        "world": world,
        "default": _rounds(world, rounds),
        "session_each": _rounds(world, rounds, **sessions),
        "thread_each": _rounds(world, rounds, max_workers=8 * world, **sessions),
    }
    row["ratio"] = round(row["session_each"]["median_s"] / row["thread_each"]["median_s"], 2)
    return row
