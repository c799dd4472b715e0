"""A server's peer token never leaves it (server/rpc/peer_credentials.py).

Replication goes to the address a ConfigureReplication call names. Here team A's scoped admin
names a port of its own: what arrives there is a credential for team A's job alone, which a
server takes for StoreReplica of that job and refuses for team B's, and never the peer token,
with which team A could have stored replicas of every job on every server.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.rpc import auth
from paramshard.server.rpc import peer_credentials as creds

pytestmark = pytest.mark.timeout(120)

PEER = "peer-secret-0123456789"
TOKENS = {
    "root": "admin",
    "a-admin": "admin jobs=team-a-*",
    "b-train": "train jobs=team-b-*",
    PEER: "peer",
}
SHARD = "/paramshard.v1.Shard/"


class Listener:
    """A port of team A's own that answers StoreReplica and keeps the credentials it got."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.arrived = threading.Event()

        def store(_raw: bytes, context: grpc.ServicerContext) -> bytes:
            for key, value in context.invocation_metadata():
                if key == "authorization":
                    self.seen.append(value)
                    self.arrived.set()
            return b""  # an empty ReplicaAck

        handler = grpc.method_handlers_generic_handler(
            "paramshard.v1.Shard",
            {"StoreReplica": grpc.unary_unary_rpc_method_handler(store)},
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0).wait(5)


def raw_call(address: str, method: str, request: Any, token: str) -> tuple[Any, str]:
    with grpc.insecure_channel(address) as chan:
        stub = chan.unary_unary(SHARD + method, request_serializer=None)
        try:
            stub(
                request.SerializeToString(),
                timeout=10,
                metadata=(("authorization", f"Bearer {token}"),),
            )
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            return exc.code(), exc.details()


@pytest.fixture()
def server() -> Any:
    s = ShardServer(tokens=TOKENS, local_calls=False).start()
    for token, job in (("a-admin", "team-a-job"), ("b-train", "team-b-job")):
        c = ShardClient(ClusterSpec([s.address], token=token), timeout_s=10, retries=0)
        c.register_buffer(job, "w", 64, optimizer="sgd", hyper={"lr": 0.1})
        c.set_params(job, "w", np.zeros(64, np.float32))
        c.close()
    yield s
    s.stop(0)


def test_replication_to_any_address_sends_a_credential_for_that_job_only(server) -> None:  # noqa: ANN001
    listener = Listener()
    try:
        config = pb.ReplicationConfig(
            job="team-a-job", every=1, server_index=0, num_servers=1,
            neighbour=f"127.0.0.1:{listener.port}",
        )  # fmt: skip
        code, details = raw_call(server.address, "ConfigureReplication", config, "a-admin")
        assert code == grpc.StatusCode.OK, details
        assert listener.arrived.wait(10)
        deadline = time.monotonic() + 10  # the first replica follows the probe
        while len(listener.seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        listener.stop()
    assert len(listener.seen) >= 2, listener.seen
    for header in listener.seen:
        assert PEER not in header
        scheme, _, credential = header.partition(" ")
        assert scheme == "Bearer" and creds.is_derived(credential), header
        assert creds.verify([PEER], credential) == ("team-a-job", "")

    # what team A can do with what it caught: replicas of its own job, nothing of team B's
    caught = listener.seen[0].partition(" ")[2]
    own = pb.ReplicaChunk(job="team-a-job", source_index=0)  # the probe: may it send?
    assert raw_call(server.address, "StoreReplica", own, caught)[0] == grpc.StatusCode.OK
    other = pb.ReplicaChunk(job="team-b-job", source_index=0)
    code, details = raw_call(server.address, "StoreReplica", other, caught)
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert "outside this token's scope" in details
    assert raw_call(server.address, "Status", pb.StatusRequest(), caught)[0] == (
        grpc.StatusCode.PERMISSION_DENIED
    )


def test_credentials_are_checked() -> None:
    now = 1_800_000_000.0
    made = creds.derive(PEER, "job-*", now)
    assert creds.verify([PEER], made, now + 299) == ("job-*", "")
    assert creds.verify(["another", PEER], made, now - 299) == ("job-*", "")
    job, why = creds.verify(["another"], made, now)
    assert job is None and "another peer token" in why
    job, why = creds.verify([PEER], made, now + 301)
    assert job is None and "+301 s old" in why and "clocks" in why
    for broken in (made[:-1] + ("0" if made[-1] != "0" else "1"), made + ".x", "peer1.zz.1.00"):
        assert creds.verify([PEER], broken, now)[0] is None, broken
    # a name is a name, not a pattern: a credential for "job-*" is not one for "job-b"
    forged = made.replace(b"job-*".hex(), b"job-b".hex())
    assert creds.verify([PEER], forged, now)[0] is None
    grant = auth.TokenAuthInterceptor(TOKENS).grant(creds.derive(PEER, "team-a-*"))
    assert grant is not None and grant.role == "peer"
    assert grant.scope.allows_job("team-a-*") and not grant.scope.allows_job("team-a-job")


def test_a_bad_credential_is_refused_with_the_reason(server) -> None:  # noqa: ANN001
    chunk = pb.ReplicaChunk(job="team-a-job", source_index=0)
    stale = creds.derive(PEER, "team-a-job", time.time() - 3600)
    code, details = raw_call(server.address, "StoreReplica", chunk, stale)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "clocks must agree" in details, details
    wrong = creds.derive("not-the-peer-token", "team-a-job")
    code, details = raw_call(server.address, "StoreReplica", chunk, wrong)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "another peer token" in details, details
