"""All-reduces of more ranks than a server has threads for waiting calls
(``python -m benchmarks.leases --reads``).

Every rank's read of an all-reduce's slot waits on the server until the last contribution is
in, and a waiting call may hold a thread only within the admission gate's bounds: 112 by
default, 56 for one token (server/rpc/admission.py). Here W ranks with one token (as a job's
ranks share one) all-reduce 16 floats through one server, round after round, the parent
starting each round once every rank ended the last. Three servers, one after another:

- ``default``: the default bounds. A server takes at most ``--max-sessions`` (64) sessions;
  ranks past them send one call a message, and their reads past the gate are refused "retry
  later" and asked again after pauses.
- ``session_each``: ``--max-sessions`` 2 W, so every rank has a session: reads past the gate
  wait in the server's line (server/transport/waiting_line.py).
- ``thread_each`` (the reference): as ``session_each`` with ``--workers`` 8 W, threads for
  every read, so the gate never holds one back.

The server runs in a process of its own, and the ranks in ``PROCESSES`` more, each rank a
thread there with its own client and channel, as ranks of processes of their own have. All
W ranks as threads of one process, beside the server, measured that process instead: 2,000-
2,700 threads on two cores, two of gRPC's a rank waking ten times a second, every call
waiting for the shared channel's lock (docs/scaling.md "Reads past the waiting threads").

Each reports the slowest rank's all-reduce, median and largest over the rounds after the
first; ``ratio``: ``session_each`` over ``thread_each``, medians (None when the reference ran no
round).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from benchmarks._processes import (
    Child,
    ChildError,
    child_env,
    child_guard,
    emit,
    expect_all,
    read_line,
    stop_all,
    wait_parent_eof,
)
from paramshard.client import ClusterSpec, ShardClient
from paramshard.server import ShardServer

__all__ = ["reads_row", "server_child", "ranks_child"]

TOKEN = "bench-team"
NUMEL = 16
PROCESSES = 6
"""Rank processes of a run (fewer when it has fewer ranks)."""
WAIT_S = 120.0
"""How long the benchmark waits for a round (or a process's start): past it, the row reports
an error."""
LIFETIME_S = 1800.0
_MODULE = "benchmarks.leases"


def _rounds(world: int, rounds: int, **bounds: Any) -> dict[str, Any]:
    """``rounds`` all-reduces of ``world`` ranks through a server with ``bounds``."""
    slowest: list[float] = []
    errors: list[str] = []
    env = child_env(tuned=True)
    kids: list[Child] = []
    try:
        server = Child.module(
            "reads-server", _MODULE, ["_reads_server", json.dumps(bounds)], env, LIFETIME_S
        )
        kids.append(server)
        address = server.expect("ADDR", WAIT_S)
        procs = min(PROCESSES, world)
        ranks = [
            Child.module(
                f"reads-ranks-{p}",
                _MODULE,
                ["_reads_ranks", address, str(world), str(p), str(procs)],
                env,
                LIFETIME_S,
            )
            for p in range(procs)
        ]
        kids += ranks
        expect_all(ranks, "READY", WAIT_S, watch=kids)
        for k in range(rounds):
            for child in ranks:
                child.send(f"ROUND {k}")
            done = [json.loads(s) for s in expect_all(ranks, "DONE", WAIT_S, watch=kids)]
            slowest.append(max(d["slowest_s"] for d in done))
            errors += [e for d in done for e in d["errors"]]
            if errors:
                break
    except ChildError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        stop_all(kids)
    timed = slowest[1:] or slowest or [0.0]
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
        "processes": min(PROCESSES, world),
        "default": _rounds(world, rounds),
        "session_each": _rounds(world, rounds, **sessions),
        "thread_each": _rounds(world, rounds, max_workers=8 * world, **sessions),
    }
    reference = row["thread_each"]["median_s"]  # 0 when it ran no round (its errors say why)
    row["ratio"] = round(row["session_each"]["median_s"] / reference, 2) if reference else None
    return row


# ================================================================================ children
def server_child(bounds: str, lifetime: float) -> None:
    """The server, with ``bounds`` (JSON: ``ShardServer``'s keyword arguments), until our
    stdin closes."""
    child_guard(lifetime)
    with ShardServer(tokens={TOKEN: "train"}, **json.loads(bounds)) as server:
        emit("ADDR", server.address)
        wait_parent_eof()


def ranks_child(address: str, world: int, index: int, procs: int, lifetime: float) -> None:
    """Ranks ``index``, ``index + procs``, ... of ``world``, each a thread with its own client;
    one all-reduce each for every ``ROUND k`` line; ``DONE`` with the slowest one's time."""
    child_guard(lifetime)
    mine = list(range(index, world, procs))
    clients = [
        ShardClient(
            ClusterSpec([address], token=TOKEN),
            rank=r,
            world_size=world,
            run_id="reads",
            timeout_s=WAIT_S / 2,
        )
        for r in mine
    ]
    expected = float(sum(range(world)))
    lock = threading.Lock()

    def one(i: int, k: int, took: list[float], errors: list[str]) -> None:
        x = np.full(NUMEL, float(mine[i]), np.float32)
        try:
            began = time.perf_counter()
            y = clients[i].all_reduce(x)
            seconds = time.perf_counter() - began
            if not np.all(y == expected):
                raise AssertionError(f"rank {mine[i]} round {k}: {y[0]} != {expected}")
            with lock:
                took.append(seconds)
        except Exception as exc:  # noqa: BLE001 - reported in the row
            with lock:
                errors.append(f"{type(exc).__name__}: {str(exc)[:120]}")

    try:
        with ThreadPoolExecutor(len(mine)) as pool:  # a thread a rank, all in one round
            emit("READY", str(len(mine)))
            while True:
                k = int(read_line("ROUND ", LIFETIME_S))
                took: list[float] = []
                errors: list[str] = []
                n = len(mine)
                list(pool.map(one, range(n), [k] * n, [took] * n, [errors] * n))
                emit("DONE", {"slowest_s": max(took, default=0.0), "errors": errors})
    finally:
        for c in clients:
            c.close()
