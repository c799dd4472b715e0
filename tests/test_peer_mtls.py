"""The peer role from a mutual-TLS identity (server/rpc/auth.py): a server given ``peer_identities``
lets a client certificate naming one of them store replicas without a token, and nothing else;
two such servers replicate to each other with no peer token at all.

Real servers with mutual TLS and tokens (read < train < admin, no peer line) on 127.0.0.1.
"""

from __future__ import annotations

import grpc
import pytest
from pki import make_pki
from test_hardening_replication import client_for, replicate_and_recover, serve_cli

from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.servicer import SERVICE_NAME

pytestmark = pytest.mark.timeout(120)

TOKENS = {"reader-secret": "read", "trainer-secret": "train", "admin-secret": "admin"}
PEER = "shard-peer"


@pytest.fixture(scope="module")
def pki() -> dict[str, bytes]:
    return make_pki({"server": ("shard server", [PEER]), "trainer": ("trainer", ["trainer"])})


@pytest.fixture
def nodes(servers, pki) -> list[ShardServer]:
    return servers(
        2,
        tokens=TOKENS,
        tls_cert=pki["server"],
        tls_key=pki["server_key"],
        tls_ca=pki["ca"],
        peer_identities=[PEER],
    )


def call(address: str, pki, cert: str, method: str, request, token: str | None = None):
    """One raw call over mutual TLS presenting certificate ``cert``."""
    creds = grpc.ssl_channel_credentials(pki["ca"], pki[f"{cert}_key"], pki[cert])
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    reply_type = {"StoreReplica": pb.ReplicaAck, "Status": pb.StatusReply}[method]
    with grpc.secure_channel(address, creds) as chan:
        stub = chan.unary_unary(
            f"/{SERVICE_NAME}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=reply_type.FromString,
        )
        return stub(request, timeout=10, metadata=metadata)


def code_of(fn, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kw)
    return info.value.code(), info.value.details()


CHUNK = pb.ReplicaChunk(job="nope", source_index=1, version=0, offset=0, total=8, data=b"x")


def test_a_peer_identity_may_store_replicas_and_nothing_else(nodes, pki) -> None:
    address = nodes[0].address
    # past authentication: the server judges the replica itself (no such job here)
    code, details = code_of(call, address, pki, "server", "StoreReplica", CHUNK)
    assert code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    assert code != grpc.StatusCode.INTERNAL and "nope" in details
    # the identity grants peer only: Status needs a token
    code, _ = code_of(call, address, pki, "server", "Status", pb.StatusRequest())
    assert code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("token", [None, "trainer-secret", "admin-secret"])
def test_other_certificates_cannot_store_replicas(nodes, pki, token) -> None:
    code, details = code_of(call, nodes[0].address, pki, "trainer", "StoreReplica", CHUNK, token)
    want = grpc.StatusCode.UNAUTHENTICATED if token is None else grpc.StatusCode.PERMISSION_DENIED
    assert code == want and "peer identities" in details, details
    # the trainer's certificate with its token trains as before
    assert call(nodes[0].address, pki, "trainer", "Status", pb.StatusRequest(), "reader-secret")


def test_servers_with_an_identity_replicate_without_a_peer_token(nodes, pki) -> None:
    spec = {"tls_ca": pki["ca"], "tls_cert": pki["trainer"], "tls_key": pki["trainer_key"]}
    replicate_and_recover(nodes, client_for([s.address for s in nodes], **spec))


def test_peer_identities_need_mutual_tls(pki) -> None:
    with pytest.raises(ValueError, match="mutual TLS"):
        ShardServer(
            "127.0.0.1",
            0,
            tls_cert=pki["server"],
            tls_key=pki["server_key"],
            peer_identities=[PEER],
        )
    result = serve_cli("--peer-identity", PEER)
    assert result.returncode == 2 and "--tls-ca" in result.stderr, result.stderr
