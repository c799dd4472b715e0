"""A server whose Python threads stall, or which a burst of calls outruns, keeps the calls that
wait to be taken up, as long and as many as its bounds say.

gRPC's Python server takes up one call at a time in a loop that needs the GIL; a call that
comes while that loop cannot run, or faster than it runs, waits in gRPC's core, which ended it
CANCELLED ("CANCELLED"), its handler never run, after 30 s
(``grpc.server_max_unrequested_time_in_server``) or once more than 1,000 waited (some at
random; all past 3,000: ``grpc.server.max_pending_requests`` and its hard limit). A CI run of
tests/test_liveness.py's busy machine lost a rank's RegisterBuffer the first way, its servers
in the test's process. The server now keeps such calls as long as any call may wait
(``--max-wait-s``, server/app.py ``GRPC_UNTAKEN_S``), and as many as ``--max-pending-calls``
(16,384 by default: 2,000 ranks' windows of 8 calls).

Here the test's own thread holds the GIL while a client process sends calls to a server in the
test's process: three during 35 s (before, the two that waited for the loop ended CANCELLED
once the GIL was let go), 4,000 over 16 connections during 8 s, and 400 past a bound of 100.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import worker_env
from liveness_rank import hold_gil

from paramshard.server.app import GRPC_UNTAKEN_S

STALL_S = GRPC_UNTAKEN_S + 5.0
CLIENT = r"""
import collections, json, sys, time, grpc
from paramshard.client import ClusterSpec, ShardClient
from paramshard.protos import shard_pb2 as pb
address, calls, channels = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
# and a rank's client, calling one by one (no session: past a server's --max-sessions)
rank = ShardClient(ClusterSpec([address]), rank=0, world_size=1, sessions=False, timeout_s=60)
assert "error" not in rank.status()[0]
# one connection each (not the process's shared one): as many ranks' would be
opened = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
          for _ in range(channels)]
stubs = []
for channel in opened:
    grpc.channel_ready_future(channel).result(timeout=30)
    status = channel.unary_unary(
        "/paramshard.v1.Shard/Status",
        request_serializer=pb.StatusRequest.SerializeToString,
        response_deserializer=pb.StatusReply.FromString,
    )
    status(pb.StatusRequest(), timeout=30)  # the server answers before the stall
    stubs.append(status)
print("ready", flush=True)
time.sleep(1.0)  # the stall has begun
sent = [stubs[i % channels].future(pb.StatusRequest(), timeout=120) for i in range(calls)]
ends = collections.Counter()
ends[rank.status()[0].get("error", "rank ok")] += 1  # sent after them all
rank.close()
for call in sent:
    try:
        call.result()
        ends["ok"] += 1
    except grpc.RpcError as exc:
        ends[f"{exc.code().name} {exc.details()}"] += 1
print(json.dumps(ends), flush=True)
for channel in opened:
    channel.close()
"""


def calls_in_a_stall(server, stall_s: float, calls: int, channels: int) -> dict[str, int]:
    """How the ``calls`` a client process sends over ``channels`` connections while this
    process holds the GIL ``stall_s`` seconds (sent 1 s into it), and then a rank's Status,
    end: {"ok" or "CODE details": how many, and "rank ok" or the rank's error: 1}."""
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, server.address, str(calls), str(channels)],
        env=worker_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert client.stdout is not None
        first = client.stdout.readline()
        assert first == "ready\n", first + client.stdout.read()
        hold_gil(stall_s)
        out, _ = client.communicate(timeout=120)
    finally:
        client.kill()
        client.wait(timeout=30)
    assert client.returncode == 0, out
    return json.loads(out.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_calls_that_came_during_a_long_stall_are_served(servers) -> None:
    (server,) = servers(1)
    assert calls_in_a_stall(server, STALL_S, 3, 1) == {"ok": 3, "rank ok": 1}


BURST = 4000
"""Calls that wait untaken at once: 500 ranks' windows of 8 (client/rpc.py ``MAX_IN_FLIGHT``).
With gRPC's own bound (1,000, past which it cancels some at random, all past 3,000), 1,418 of
them ended CANCELLED "CANCELLED" (and, outside this test, 211 of 2,000 in such a stall, 250 of
3,000 sent at once with no stall)."""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_burst_of_many_ranks_calls_waits_for_the_server(servers) -> None:
    (server,) = servers(1)
    assert calls_in_a_stall(server, 8.0, BURST, 16) == {"ok": BURST, "rank ok": 1}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_calls_past_max_pending_calls_end_cancelled_and_the_server_goes_on(servers) -> None:
    (server,) = servers(1, max_pending_calls=100)
    ends = calls_in_a_stall(server, 8.0, 400, 4)
    # the first 100 wait, the rest were cancelled as they came (a few may have been taken up
    # in a moment the stall let the server run); the rank's client, dropped too, asked again
    # until the server took its call up (before: it failed CANCELLED)
    assert set(ends) == {"ok", "CANCELLED CANCELLED", "rank ok"}, ends
    assert 100 <= ends["ok"] < 400 - 200, ends
    assert calls_in_a_stall(server, 0.0, 50, 1) == {"ok": 50, "rank ok": 1}  # it serves again
