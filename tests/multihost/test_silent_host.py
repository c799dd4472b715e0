"""A trainer's host that goes silent (its cable cut: no FIN, no RST, nothing) is taken for lost
after the servers' TCP user timeout, not before and not never (server/app.py,
server/collectives/lease_holds.py).

A server in namespace s0, rank 0 in t0 and rank 1 in t1, both holding their lease. t0's cable
is cut: rank 0's renewals stop and its lease stream goes quiet, yet its lease holds until the
server's heartbeats on that stream have gone unacknowledged for ``TCP_USER_TIMEOUT_S``; then
the kernel closes the connection, the stream ends and rank 1 hears "rank 0 lost".
"""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from paramshard.server.app import TCP_USER_TIMEOUT_S
from paramshard.server.collectives.lease_holds import HEARTBEAT_S
from paramshard.server.collectives.leases import STREAM_GRACE_S

from .conftest import NetLab

pytestmark = [pytest.mark.multihost, pytest.mark.slow, pytest.mark.timeout(300)]

RANK = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from paramshard.client import ClusterSpec, ShardClient
    address, rank, run = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    c = ShardClient(ClusterSpec([address]), rank=rank, world_size=2, run_id=run, timeout_s=60)
    c.all_reduce(np.ones(3, dtype=np.float32))  # both ranks are there, their streams are up
    print("holding", flush=True)
    while (notice := c.run_state.current()) is None:
        time.sleep(0.1)
    print(f"NOTICE {time.monotonic()} {notice.reason}", flush=True)
    """
)


def test_a_silent_host_is_lost_after_the_tcp_user_timeout(netlab: NetLab) -> None:
    server = netlab.run_in(
        "s0",
        "server-silent",
        [sys.executable, "-m", "paramshard", "serve", "--host", netlab.ip["s0"], "--port"]
        + ["50051", "--insecure"],
    )
    server.wait_for_line("listening on", 60)
    address = netlab.address("s0")
    ranks = [
        netlab.run_in(t, f"rank-{r}", [sys.executable, "-c", RANK, address, str(r), "silent"])
        for r, t in enumerate(("t0", "t1"))
    ]
    for rank in ranks:
        rank.wait_for_line("holding", 120)
    netlab.set_link("t0", up=False)
    cut = time.monotonic()
    try:
        line = ranks[1].wait_for_line("NOTICE", TCP_USER_TIMEOUT_S + 60)
    finally:
        netlab.set_link("t0", up=True)
    at, reason = line.split(" ", 2)[1:]
    after = float(at) - cut
    print(f"[multihost] rank 1 heard of rank 0 {after:.1f} s after the cut: {reason}")
    assert "rank 0 lost (its lease stream" in reason, reason
    # not before the kernel gave up on the connection; soon after it
    assert TCP_USER_TIMEOUT_S <= after <= TCP_USER_TIMEOUT_S + HEARTBEAT_S + STREAM_GRACE_S + 10
    server.stop()
