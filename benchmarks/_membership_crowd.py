"""An elastic step's Joins through a real server, more ranks than it has threads for waiting
calls (``python -m benchmarks.leases --crowd``).

A Join waits on the coordinator for its round's decision, holding a handler thread, and the
admission gate lets in at most ``--workers`` less ``--reserved-workers`` waiting calls (112 by
default, 56 for one token; server/rpc/admission.py). Here W ranks, each a thread of this process
with its own client and the same token (as a job's ranks share one), Join step 0 of one job on
one in-process server with the default bounds, a round window of ``WINDOW_S``: how many became
members of the step, how long the last one took, and which errors the others got.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.membership import Membership
from paramshard.server import ShardServer

__all__ = ["crowd_row"]

WINDOW_S = 10.0
WAIT_S = 100.0
"""How long the benchmark waits for every rank: past it, the ranks still waiting are counted."""
TOKEN = "bench-team"


def crowd_row(world: int) -> dict[str, Any]:
    """W ranks Join one step at once; what they got."""
    with ShardServer(tokens={TOKEN: "train"}) as server:
        spec = ClusterSpec([server.address], token=TOKEN)
        clients = [
            ShardClient(spec, rank=r, world_size=world, run_id="crowd", timeout_s=60)
            for r in range(world)
        ]
        got: dict[int, Any] = {}
        ended: dict[int, float] = {}
        began = time.monotonic()

        def rank(r: int) -> None:
            m = Membership(clients[r], "crowd", min_members=1, window_s=WINDOW_S, wait_s=60)
            try:
                answer = m.join(0)
            except Exception as exc:  # noqa: BLE001 - counted in the row
                answer = f"{type(exc).__name__}: {str(exc)[:80]}"
            ended[r] = time.monotonic() - began
            got[r] = answer  # last: a rank in ``got`` has its time in ``ended``

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(max(0.0, began + WAIT_S - time.monotonic()))
            answered = dict(got)  # before the clients close: the others still wait
        finally:
            for c in clients:
                c.close()
    steps = Counter((g.step, len(g.members)) for g in answered.values() if not isinstance(g, str))
    return {
        "world": world,
        "members_of_step_0": max((n for (s, n) in steps if s == 0), default=0),
        "still_waiting": world - len(answered),
        "last_answer_s": round(max((ended[r] for r in answered), default=0.0), 2),
        "errors": dict(Counter(g for g in answered.values() if isinstance(g, str))),
    }
