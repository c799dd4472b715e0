"""A rank's renewals to a server that answers late (client/lease_renewals.py, ``send_due``).

A server that falls behind (a machine too busy for it, a crowd of ranks) answers a renewal
seconds after it came. Its renewal may wait as long as the rank's pace there, and no second
one goes to that server while it waits: before, a renewal had 1 s, one that timed out counted
as a failure towards a lost server, and it was sent again a second later, so the server that
was behind got more renewals than one that kept up. Meanwhile the process's other leases are
renewed at their own pace: the renewing thread does not wait for the late answer.

The server here is a real one whose lease table takes ``SLOW_S`` to answer the test's run.
"""

from __future__ import annotations

import threading
import time

from conftest import unique_id
from test_contribute_read import wait_for

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.lease_keeper import RENEWALS_A_SECOND, renewal_pace

SLOW_S = 2.5  # longer than the 1 s a renewal had before, shorter than the pace below
WORLD = 10 * RENEWALS_A_SECOND  # a rank with a stream renews each server every 10 s


def _counted(table, runs: dict[str, list[float]], slow: set[str], lock: threading.Lock):
    """Wraps ``table.renew``: records when each renewal of ``runs`` came, answers those of
    ``slow`` runs ``SLOW_S`` late. Returns the original."""
    renew = table.renew

    def counted(req, owner=None):
        if req.run in runs:
            with lock:
                runs[req.run].append(time.monotonic())
            if req.run in slow:
                time.sleep(SLOW_S)
        return renew(req, owner)

    table.renew = counted
    return renew


def test_a_late_answer_lands_and_no_second_renewal_goes_while_it_waits(servers):
    slow_srv, fast_srv = servers(2, local_calls=False)
    slow_run, fast_run = unique_id(), unique_id()
    came: dict[str, list[float]] = {slow_run: [], fast_run: []}
    lock = threading.Lock()
    renews = [_counted(s.servicer.leases, came, {slow_run}, lock) for s in (slow_srv, fast_srv)]
    slow = ShardClient(ClusterSpec([slow_srv.address]), rank=0, world_size=WORLD, run_id=slow_run)
    fast = ShardClient(ClusterSpec([fast_srv.address]), rank=0, world_size=2, run_id=fast_run)
    try:
        holding = slow.run_state.holding
        assert renewal_pace(WORLD, holding.ttl_s, streamed=True) == 10.0
        wait_for(lambda: holding.holds.get(0) is not None and holding.holds[0].open, 10)
        wait_for(lambda: bool(came[slow_run]), 5)  # the first paced renewal came
        first = came[slow_run][0]
        time.sleep(max(0.0, first + 6.0 - time.monotonic()))
        with lock:
            slow_came = [round(t - first, 1) for t in came[slow_run]]
            fast_came = [t for t in came[fast_run] if first <= t <= first + 6.0]
        # before: one a second (each timed out after 1 s and was sent again): 6 in 6 s
        assert slow_came == [0.0], f"renewals came at {slow_came} s: one was due in 10 s"
        # it waited SLOW_S in the server and was answered, not failed
        assert 0 in holding.answered and holding.failing_since == {}, holding.failing_since
        # the other lease, on the same renewing thread, kept its pace (1 s) meanwhile
        assert len(fast_came) >= 4, f"{len(fast_came)} renewals of the 1 s lease in 6 s"
    finally:
        slow.close()
        fast.close()
        for srv, renew in zip((slow_srv, fast_srv), renews, strict=True):
            srv.servicer.leases.renew = renew
