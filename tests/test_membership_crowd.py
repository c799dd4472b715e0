"""An elastic job with more ranks than its coordinator has threads for waiting calls: every rank
is heard, and every rank is a member of the step.

A Join waits on the coordinator for its round's decision, holding a handler thread, and the
admission gate lets at most ``workers - reserved`` waiting calls in (half of them for one token:
server/rpc/admission.py). Beyond that it refused Joins "retry later", so the ranks past the
bound could not announce themselves: a round decided at its window without them (measured with
the defaults, 150 ranks: 124 members after 11 s without tokens; with one token 77, and 5 ranks
failed after their minute of retries). Now a Join past the bound announces its rank and answers
at once, "ask again after a pause" (``ANSWERS_AT_ONCE``, ``JoinReply.retry_after_ms``).

Real servers with a small pool (6 threads for waiting calls, 3 for one token) and 24 ranks,
threads of this process, each with its own client, through unary calls and through sessions.
"""

from __future__ import annotations

import threading
import time

import pytest

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.membership import Membership
from paramshard.server import ShardServer

WORLD = 24
WINDOW_S = 3.0
"""A round waits this long for its expected ranks once the first is there: past it, it goes on
without the ones it has not heard."""


@pytest.mark.parametrize("token", [None, "team"], ids=["no-tokens", "one-token"])
@pytest.mark.parametrize("sessions", [False, True], ids=["unary", "sessions"])
def test_every_rank_of_a_job_larger_than_the_waiting_threads_is_a_member(token, sessions):
    kw = {"tokens": {token: "train"}} if token else {}
    with ShardServer(max_workers=8, reserved_workers=2, **kw) as server:
        clients = [
            ShardClient(
                ClusterSpec([server.address], token=token),
                rank=r, world_size=WORLD, run_id="crowd", timeout_s=30, sessions=sessions,
            )
            for r in range(WORLD)
        ]  # fmt: skip
        got: dict[int, object] = {}

        def rank(r: int) -> None:
            m = Membership(clients[r], "crowd", min_members=1, window_s=WINDOW_S, wait_s=30)
            try:
                got[r] = m.join(0)
            except Exception as exc:  # noqa: BLE001 - reported below, with the rank
                got[r] = exc

        began = time.monotonic()
        try:
            threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(WORLD)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(max(0.0, began + 60 - time.monotonic()))
        finally:
            for c in clients:
                c.close()
        assert sorted(got) == list(range(WORLD)), (
            f"ranks still waiting: {set(range(WORLD)) - set(got)}"
        )
        for r, step in got.items():
            assert not isinstance(step, Exception), (r, step)
            assert step.step == 0 and step.members == tuple(range(WORLD)), (r, step)
