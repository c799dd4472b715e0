"""Issue 13, findings 1-3: replicas are bounded, come only from the predecessor with the peer
token, and go only to the job's next server, over TLS when the servers serve TLS.

Real servers on 127.0.0.1:0 with tokens (read < train < admin, and peer: the servers' own).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import port_to_reuse, worker_env
from pki import make_pki

from paramshard.client import ClusterSpec, ShardClient, StepArgs, tools
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb
from paramshard.server import MALLOC_ENV, ShardServer
from paramshard.server.rpc import auth, tokens
from paramshard.server.servicer import SERVICE_NAME
from paramshard.server.snapshots.shards import Captured, encode_shard

pytestmark = pytest.mark.timeout(120)

TOKENS = {
    "reader-secret": "read",
    "trainer-secret": "train",
    "admin-secret": "admin",
    "peer-secret": "peer",
}
N = 1000  # elements of the test buffer


def client_for(addresses: list[str], token: str = "admin-secret", **spec: object) -> ShardClient:
    return ShardClient(ClusterSpec(list(addresses), token=token, **spec), timeout_s=15.0, retries=0)


def register(c: ShardClient, job: str) -> None:
    c.register_buffer(job, "w", N, optimizer="adam", hyper={"lr": 0.1})
    c.set_params(job, "w", np.arange(N, dtype=np.float32))


def step(c: ShardClient, job: str, s: int) -> None:
    c.push_grads(job, "w", np.ones(N, np.float32), step=s)
    c.step(job, s, {"w": StepArgs({"lr": 0.1})})


def store(address: str, chunk: pb.ReplicaChunk, token: str | None = "peer-secret") -> pb.ReplicaAck:
    """One raw StoreReplica call, as another server (or a stranger) would make it."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as chan:
        call = chan.unary_unary(
            f"/{SERVICE_NAME}/StoreReplica",
            request_serializer=pb.ReplicaChunk.SerializeToString,
            response_deserializer=pb.ReplicaAck.FromString,
        )
        return call(chunk, timeout=10, metadata=metadata)


def refused(
    address: str, chunk: pb.ReplicaChunk, token: str | None = "peer-secret"
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        store(address, chunk, token)
    assert info.value.code() != grpc.StatusCode.INTERNAL, info.value.details()
    return info.value


def replica_blob(job: str, source: int, num: int, version: int) -> bytes:
    """A well-formed replica of ``source``'s slice of the test buffer."""
    start, numel = source * (N // num), N // num
    captured = [Captured("w", start, np.zeros(numel, np.float32), {}, 0)]
    spec = pb.RegisterBufferRequest(ref=pb.BufferRef(job=job, buffer="w"), numel=N)
    return encode_shard(
        job, "replica", source, num, version, captured, {"w": spec.SerializeToString()}
    )


@pytest.fixture
def pair(servers) -> Iterator[tuple[list[ShardServer], ShardClient]]:
    """Two servers with tokens holding job 'j' (slice 0 on server 0, slice 1 on server 1)."""
    nodes = servers(2, tokens=TOKENS, replica_ttl_s=1.0)
    c = client_for([s.address for s in nodes])
    register(c, "j")
    yield nodes, c
    c.close()


# ------------------------------------------------------------------- 1: replica memory bomb
def test_replica_size_is_bounded_by_the_registered_job(pair) -> None:
    (_, second), _ = pair
    inbox = second.servicer.replicator.inbox
    for total in (512 * 2**20, 2**62, 2**64 - 1):
        chunk = pb.ReplicaChunk(job="j", source_index=0, version=1, total=total, data=b"x")
        err = refused(second.address, chunk)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert "job 'j'" in err.details() and f"{total:,}" in err.details()
    assert inbox.pending() == {}
    # an unknown job has no size: refused
    err = refused(second.address, pb.ReplicaChunk(job="nojob", total=10, data=b"x"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "nojob" in err.details()
    # within the bound: kept as received, nothing allocated for the rest
    total = 50_000
    ack = store(second.address, pb.ReplicaChunk(job="j", version=1, total=total, data=b"x"))
    assert not ack.complete
    assert inbox.pending() == {("held", "j", 0, 1): (1, total)}


# ---------------------------------------------------------------------- 2: replica spoofing
def test_store_replica_needs_the_peer_token(pair) -> None:
    (_, second), _ = pair
    chunk = pb.ReplicaChunk(job="j", source_index=0, version=5, total=8, data=b"12345678")
    for token, code in (
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("trainer-secret", grpc.StatusCode.PERMISSION_DENIED),
        ("admin-secret", grpc.StatusCode.PERMISSION_DENIED),
    ):
        err = refused(second.address, chunk, token)
        assert err.code() == code and "'peer'" in err.details(), (token, err.details())
    # the peer token calls nothing else
    peer = client_for([second.address], token="peer-secret")
    try:
        with pytest.raises(ShardClientError) as info:
            peer.call(0, "Status", pb.StatusRequest())
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        peer.close()
    assert second.servicer.replicator.list("j") == []
    assert auth.role_allows("peer", "peer") and not auth.role_allows("admin", "peer")
    assert not auth.role_allows("peer", "read")
    assert tokens.parse_token_file("peer p-1\nadmin a-1\n") == {"p-1": "peer", "a-1": "admin"}


def test_store_replica_only_from_the_predecessor(servers) -> None:
    (one,) = servers(1, tokens=TOKENS)
    c = client_for([one.address])
    try:
        register(c, "j")
        blob = replica_blob("j", 7, 8, 3)
        chunk = pb.ReplicaChunk(job="j", source_index=7, version=3, total=len(blob), data=blob)
        err = refused(one.address, chunk)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "only from server 0" in err.details() and "slice 0 of 1" in err.details()
        assert one.servicer.replicator.list("j") == []
    finally:
        c.close()


def test_replica_complete_only_when_every_byte_is_covered_once(pair) -> None:
    (_, second), _ = pair
    rep = second.servicer.replicator
    blob = replica_blob("j", 0, 2, 4)
    total = len(blob)
    assert total > 1024

    def chunk(offset: int, size: int, version: int = 4, **kw: object) -> pb.ReplicaChunk:
        data = blob[offset : offset + size]
        return pb.ReplicaChunk(
            job="j", source_index=0, version=version, offset=offset, total=total, data=data, **kw
        )

    # two 1-byte chunks do not complete it (the old count of offsets did)
    assert not store(second.address, chunk(0, 1)).complete
    assert not store(second.address, chunk(total - 1, 1)).complete
    # the same chunk again (a retry, a recovery asked again) changes nothing: it was refused
    # as an overlap, and a LoadReplica cut short could not be done again for 300 s
    assert not store(second.address, chunk(0, 1)).complete
    # overlapping chunks and a changed total are refused, naming the ranges
    err = refused(second.address, chunk(0, 10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "overlaps" in err.details()
    err = refused(second.address, chunk(total - 5, 5))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "overlaps" in err.details()
    bad_total = pb.ReplicaChunk(job="j", version=4, offset=1, total=total + 1, data=blob[1:2])
    err = refused(second.address, bad_total)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and f"{total:,}" in err.details()
    assert rep.list("j") == []
    # the rest, out of order: complete at the last byte
    middle = (total - 2) // 2
    assert not store(second.address, chunk(1 + middle, total - 2 - middle)).complete
    assert store(second.address, chunk(1, middle)).complete
    (row,) = rep.list("j")
    assert (row.source_index, row.version, row.bytes, row.own) == (0, 4, total, False)
    # a replica whose own header names another source or version is refused
    other = replica_blob("j", 0, 2, 9)
    err = refused(
        second.address, pb.ReplicaChunk(job="j", version=10, total=len(other), data=other)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "v9" in err.details()
    assert [r.version for r in rep.list("j")] == [4]


def test_incomplete_replicas_expire(pair) -> None:
    (_, second), _ = pair
    inbox = second.servicer.replicator.inbox  # replica_ttl_s=1.0
    store(second.address, pb.ReplicaChunk(job="j", version=1, total=5000, data=b"abc"))
    assert inbox.pending()
    deadline = time.monotonic() + 10
    while inbox.pending() and time.monotonic() < deadline:
        time.sleep(0.1)  # nothing else arrives: the sender thread's sweep drops it
    assert inbox.pending() == {}
    # and at most two incomplete versions per source are kept meanwhile
    for version in (1, 2, 3):
        store(second.address, pb.ReplicaChunk(job="j", version=version, total=5000, data=b"a"))
    assert sorted(k[3] for k in inbox.pending()) == [2, 3]


# ----------------------------------------------------------------- 3: replication anywhere
def test_configure_replication_is_admin_and_stays_in_the_placement(servers) -> None:
    nodes = servers(3, tokens=TOKENS)
    addresses = [s.address for s in nodes]
    admin = client_for(addresses)
    trainer = client_for(addresses, token="trainer-secret")
    try:
        register(admin.on_servers([0, 1]), "j")  # placement: slice 0 on server 0, 1 on 1

        def configure(c: ShardClient, neighbour: str, index: int = 0, num: int = 2) -> Exception:
            cfg = pb.ReplicationConfig(
                job="j", every=1, neighbour=neighbour, server_index=index, num_servers=num
            )
            with pytest.raises(ShardClientError) as info:
                c.call(0, "ConfigureReplication", cfg)
            assert info.value.code != grpc.StatusCode.INTERNAL, info.value.details
            return info.value

        err = configure(trainer, addresses[1])
        assert err.code == grpc.StatusCode.PERMISSION_DENIED and "'admin'" in err.details
        with pytest.raises(PermissionError, match="replicate_every for job 'j' needs an admin"):
            tools.configure_replication(trainer.on_servers([0, 1]), "j", 1)  # what a trainer calls
        for outside in (addresses[2], addresses[0]):  # not in the placement; itself (slice 0)
            err = configure(admin, outside)
            assert err.code == grpc.StatusCode.PERMISSION_DENIED, err.details
            assert outside in err.details and "slice 1 of 2" in err.details
        err = configure(admin, "127.0.0.1:1")  # nobody there
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION and "127.0.0.1:1" in err.details
        err = configure(admin, addresses[1], index=1)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "slice 0 of 2" in err.details
        rep = nodes[0].servicer.replicator
        assert rep.configs == {} and rep._channels == {}  # noqa: SLF001 - nothing left open

        # the job's own next server: replicas flow, with the peer token
        tools.configure_replication(admin.on_servers([0, 1]), "j", 1)
        step(admin.on_servers([0, 1]), "j", 0)
        deadline = time.monotonic() + 20
        held = []
        while time.monotonic() < deadline and {r.version for r in held} != {0, 1}:
            held = [r for r in nodes[1].servicer.replicator.list("j") if not r.own]
            time.sleep(0.05)
        assert {(r.source_index, r.version) for r in held} == {(0, 0), (0, 1)}
        assert list(rep._channels) == [addresses[1]]  # noqa: SLF001

        # stopping closes the channel; dropping the job forgets its replicas
        tools.configure_replication(admin.on_servers([0, 1]), "j", 0)
        assert rep.configs == {} and rep._channels == {}  # noqa: SLF001
        admin.call(1, "DropJob", pb.DropJobRequest(job="j"))
        assert nodes[1].servicer.replicator.list("j") == []
    finally:
        admin.close()
        trainer.close()


def test_replication_needs_a_peer_token_when_servers_have_tokens(servers) -> None:
    no_peer = {t: r for t, r in TOKENS.items() if r != "peer"}
    nodes = servers(2, tokens=no_peer)
    c = client_for([s.address for s in nodes])
    try:
        register(c, "j")
        with pytest.raises(ShardClientError) as info:
            tools.configure_replication(c, "j", 1)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "'peer TOKEN'" in info.value.details
    finally:
        c.close()


def test_send_queue_is_bounded(pair) -> None:
    (first, _), c = pair
    rep = first.servicer.replicator
    release, sent = threading.Event(), []

    def slow_send(cfg: pb.ReplicationConfig, version: int, blob: bytes) -> None:
        sent.append(version)
        release.wait(20)

    tools.configure_replication(c, "j", 1)
    rep._send = slow_send  # noqa: SLF001 - a neighbour that takes forever
    try:
        for s in range(10):
            step(c, "j", s)
        assert len(rep._queue) <= rep.queue_size  # noqa: SLF001
    finally:
        release.set()


# ----------------------------------------------------------------------------- TLS between servers
def _pki() -> dict[str, bytes]:
    """A CA and one certificate for 127.0.0.1 that serves and is a client (servers call each
    other with it under mutual TLS)."""
    pki = make_pki({"cert": ("shard server", [])})
    return {"ca": pki["ca"], "cert": pki["cert"], "key": pki["cert_key"]}


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_replicas_travel_over_tls(servers, mutual: bool) -> None:
    pki = _pki()
    tls = {"tls_cert": pki["cert"], "tls_key": pki["key"]}
    tls |= {"tls_ca": pki["ca"]} if mutual else {"peer_tls_ca": pki["ca"]}
    nodes = servers(2, tokens=TOKENS, **tls)
    spec = {"tls_ca": pki["ca"]}
    if mutual:
        spec |= {"tls_cert": pki["cert"], "tls_key": pki["key"]}
    replicate_and_recover(nodes, client_for([s.address for s in nodes], **spec))


def replicate_and_recover(nodes: list[ShardServer], c: ShardClient) -> None:
    """Job 'j' replicated every step between the two ``nodes``: each holds its neighbour's
    versions 0 and 1 (bounded wait), and recovery reads them back. Closes ``c``."""
    try:
        register(c, "j")
        tools.configure_replication(c, "j", 1)
        step(c, "j", 0)
        deadline = time.monotonic() + 20
        held: list = [[], []]
        while time.monotonic() < deadline and any(len(h) < 2 for h in held):
            held = [[r for r in s.servicer.replicator.list("j") if not r.own] for s in nodes]
            time.sleep(0.05)
        assert [sorted(r.version for r in h) for h in held] == [[0, 1], [0, 1]]
        assert tools.recover_from_replicas(c, "j") == 1
    finally:
        c.close()


def serve_cli(*flags: str) -> subprocess.CompletedProcess:
    """``paramshard serve --port 0 FLAGS`` run to its end (bounded): for usage errors."""
    return subprocess.run(
        [sys.executable, "-m", "paramshard", "serve", "--port", "0", *flags],
        cwd=Path(__file__).resolve().parents[1],
        env={**worker_env(), **MALLOC_ENV},  # this checkout first, the caller's path kept
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_serve_peer_ca_needs_tls() -> None:
    result = serve_cli("--peer-ca", "ca.pem")
    assert result.returncode == 2, result.stderr
    assert "--peer-ca" in result.stderr and "--tls-cert" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_neighbour_back_from_an_outage_is_probed_at_once(servers) -> None:
    """Found in review: after a neighbour was down a while, its server's channel to it sat in
    gRPC's reconnect backoff, and ConfigureReplication refused for seconds after the
    neighbour was back (5.9 s after a 15 s outage), each refusal costing a recovery one of
    its rounds. A probe refused at once is now asked again on a new channel."""
    (first,) = servers(1)
    port = port_to_reuse()
    second = ShardServer("127.0.0.1", port).start()
    addresses = [first.address, f"127.0.0.1:{port}"]
    c = ShardClient(ClusterSpec(addresses), timeout_s=10, retries=0)
    try:
        c.register_buffer("j", "w", 64)
        tools.configure_replication(c, "j", 1)
        second.stop(0)
        to_second = pb.ReplicationConfig(job="j", every=1, neighbour=addresses[1], num_servers=2)
        for _ in range(8):  # probes while it is down: the channel backs off further each time
            with pytest.raises(ShardClientError):
                c.call(0, "ConfigureReplication", to_second)
            time.sleep(0.5)
        second = ShardServer("127.0.0.1", port).start()  # back, empty: the job again
        c.register_buffer("j", "w", 64)
        c.call(0, "ConfigureReplication", to_second)  # before: UNAVAILABLE for seconds
    finally:
        c.close()
        second.stop(0)
