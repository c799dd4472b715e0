"""A recovery round's leader that never held a lease on its coordinator (the coordinator had
restarted) and died before restoring: the coordinator counts it as gone ``UNSEEN_S`` after its
last Join (server/collectives/rounds.py), and the next live member leads. Before, a rank never
seen holding a lease counted as alive for good, and the others waited for its ``done`` until
``elastic_wait_s`` (600 s by default), then recovered again.

A real in-process server; rank 1 is a client holding its lease; rank 0 is one Join sent as it
(through rank 1's channel), with no lease: a process killed right after it.
"""

from __future__ import annotations

import time

import pytest

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.membership import Membership
from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives import rounds

pytestmark = pytest.mark.timeout(120)
JOB, RUN = "unseen", "unseen-run"
UNSEEN_S = 5.0
WAIT_S = 30.0  # elastic_wait_s: how long rank 1 waited before the change


def test_a_leader_that_died_before_leasing_on_the_coordinator_is_replaced(
    servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rounds, "UNSEEN_S", UNSEEN_S)
    (node,) = servers(1)
    client = ShardClient(ClusterSpec([node.address]), rank=1, world_size=2, run_id=RUN)
    try:
        member = Membership(client, JOB, min_members=1, window_s=5.0, wait_s=WAIT_S)
        dead = pb.JoinRequest(
            run=RUN, job=JOB, rank=0, world_size=2, epoch=client.run_state.epoch,
            recovery=True, min_members=1, window_ms=5000, known_members=[0, 1],
        )  # fmt: skip
        heard = time.monotonic()
        first = client.call(0, "Join", dead)  # rank 0 announces, then is never heard again
        assert not first.decided  # the round waits for rank 1, alive and expected
        assert member.recovery(client.run_state.epoch)  # rank 1 leads after all
        waited = time.monotonic() - heard
        # the round named rank 0 (heard within UNSEEN_S) until UNSEEN_S after its Join
        assert UNSEEN_S - 0.5 < waited < UNSEEN_S + 5, f"rank 1 led after {waited:.1f} s"
    finally:
        client.close()
