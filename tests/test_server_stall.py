"""A server whose Python threads stall longer than gRPC's 30 s keeps the calls that came meanwhile.

gRPC's Python server takes up one call at a time in a loop that needs the GIL; a call that
comes while that loop cannot run waits in gRPC's core, which ended it CANCELLED ("CANCELLED")
after 30 s, its handler never run (``grpc.server_max_unrequested_time_in_server``). A CI run
of tests/test_liveness.py's busy machine lost a rank's RegisterBuffer that way, its servers in
the test's process. The server now keeps such calls as long as any call may wait
(``--max-wait-s``, server/app.py ``GRPC_UNTAKEN_S``).

Here the test's own thread holds the GIL for 35 s while a client process sends three calls to
a server in the test's process: the first was ready to be taken before the stall, the other
two waited for the loop. Before, both ended CANCELLED once the GIL was let go.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import worker_env
from liveness_rank import hold_gil

from paramshard.server.app import GRPC_UNTAKEN_S

STALL_S = GRPC_UNTAKEN_S + 5.0
CLIENT = r"""
import sys, time, grpc
from paramshard.protos import shard_pb2 as pb
channel = grpc.insecure_channel(sys.argv[1])
grpc.channel_ready_future(channel).result(timeout=30)
status = channel.unary_unary(
    "/paramshard.v1.Shard/Status",
    request_serializer=pb.StatusRequest.SerializeToString,
    response_deserializer=pb.StatusReply.FromString,
)
status(pb.StatusRequest(), timeout=30)  # the server answers before the stall
print("ready", flush=True)
time.sleep(1.0)  # the stall has begun
calls = [status.future(pb.StatusRequest(), timeout=120) for _ in range(3)]
for call in calls:
    try:
        call.result()
        print("ok", flush=True)
    except grpc.RpcError as exc:
        print(f"failed {exc.code().name} {exc.details()!r}", flush=True)
channel.close()
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_calls_that_came_during_a_long_stall_are_served(servers) -> None:
    (server,) = servers(1)
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, server.address],
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
        hold_gil(STALL_S)
        out, _ = client.communicate(timeout=120)
    finally:
        client.kill()
        client.wait(timeout=30)
    assert out.splitlines() == ["ok"] * 3, out
