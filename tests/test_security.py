"""docs/design.md §6.1: TLS, mutual TLS, bearer tokens with roles, and the binding rule.

Certificates are made per session (tests/pki.py, the ``pki`` fixture). ``paramshard serve``'s
security flags: tests/test_security_serve.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramshard.client import ClusterSpec, ShardClient, StepArgs
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.rpc import auth, tokens
from paramshard.server.servicer import SERVICE_NAME

pytest.importorskip("cryptography.x509")
from pki import Pki  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TOKENS = {"reader-secret": "read", "trainer-secret": "train", "admin-secret": "admin"}


def client_for(address: str, **spec: object) -> ShardClient:
    """A rank-0-of-1 client that fails fast (no retries: a refused handshake is UNAVAILABLE)."""
    return ShardClient(ClusterSpec([address], **spec), timeout_s=5.0, retries=0)


def train_one_step(c: ShardClient, job: str, n: int = 64) -> np.ndarray:
    c.register_buffer(job, "w", n, optimizer="sgd", hyper={"lr": 0.5})
    c.set_params(job, "w", np.ones(n, np.float32))
    c.push_grads(job, "w", np.full(n, 2.0, np.float32), step=0)
    c.step(job, 0, {"w": StepArgs({"lr": 0.5})})
    return c.pull_params(job, "w", n, min_version=1)


# ------------------------------------------------------------------------------------------ TLS
def test_tls_round_trip(pki: Pki) -> None:
    with ShardServer(tls_cert=pki.server_cert, tls_key=pki.server_key) as s:
        assert s.tls and not s.mutual_tls
        c = client_for(s.address, tls_ca=pki.ca)
        try:
            np.testing.assert_array_equal(train_one_step(c, "tls"), np.zeros(64, np.float32))
            (row,) = c.status()
            assert "error" not in row, row
        finally:
            c.close()


def test_tls_server_name_override(pki: Pki) -> None:
    with ShardServer(tls_cert=pki.server_cert, tls_key=pki.server_key) as s:
        c = client_for(s.address, tls_ca=pki.ca, tls_server_name="localhost")
        try:
            assert "error" not in c.status()[0]
        finally:
            c.close()


def test_plaintext_client_cannot_talk_to_tls_server(pki: Pki) -> None:
    with ShardServer(tls_cert=pki.server_cert, tls_key=pki.server_key) as s:
        c = client_for(s.address)
        try:
            with pytest.raises(ShardClientError) as info:
                c.call(0, "Status", pb.StatusRequest())
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            c.close()


def test_client_rejects_server_of_another_ca(pki: Pki) -> None:
    with ShardServer(tls_cert=pki.server_cert, tls_key=pki.server_key) as s:
        c = client_for(s.address, tls_ca=pki.other_ca)
        try:
            with pytest.raises(ShardClientError) as info:
                c.call(0, "Status", pb.StatusRequest())
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            c.close()


def test_mutual_tls(pki: Pki) -> None:
    with ShardServer(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca) as s:
        assert s.mutual_tls
        good = client_for(
            s.address, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key
        )
        no_cert = client_for(s.address, tls_ca=pki.ca)
        impostor = client_for(
            s.address,
            tls_ca=pki.ca,
            tls_cert=pki.other_client_cert,
            tls_key=pki.other_client_key,
        )
        try:
            np.testing.assert_array_equal(train_one_step(good, "mtls"), np.zeros(64, np.float32))
            for c in (no_cert, impostor):
                with pytest.raises(ShardClientError) as info:
                    c.call(0, "Status", pb.StatusRequest())
                assert info.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            for c in (good, no_cert, impostor):
                c.close()


def test_tls_arguments_are_checked(pki: Pki) -> None:
    with pytest.raises(ValueError, match="tls_key"):
        ShardServer(tls_cert=pki.server_cert)
    with pytest.raises(ValueError, match="not PEM"):
        ShardServer(tls_cert=b"nonsense", tls_key=pki.server_key)
    with pytest.raises(ValueError, match="go together"):
        ClusterSpec(["127.0.0.1:1"], tls_cert=pki.client_cert)


def test_cluster_spec_reads_tls_and_token_from_env(
    pki_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PARAMSHARD_SERVERS", "127.0.0.1:1,127.0.0.1:2")
    monkeypatch.setenv("PARAMSHARD_TOKEN", "trainer-secret\n")
    monkeypatch.setenv("PARAMSHARD_TLS_CA", str(pki_files["ca"]))
    monkeypatch.setenv("PARAMSHARD_TLS_SERVER_NAME", "localhost")
    spec = ClusterSpec.from_env()
    assert spec.tls and spec.tls_ca == pki_files["ca"].read_bytes()
    assert spec.tls_server_name == "localhost"
    assert spec.metadata() == (("authorization", "Bearer trainer-secret"),)


# --------------------------------------------------------------------------------------- tokens
@pytest.fixture
def token_server() -> Iterator[ShardServer]:
    with ShardServer(tokens=TOKENS) as s:
        yield s


def rpc_error(fn, *args, **kw) -> ShardClientError:  # noqa: ANN001
    with pytest.raises(ShardClientError) as info:
        fn(*args, **kw)
    return info.value


def test_no_token_is_unauthenticated(token_server: ShardServer) -> None:
    c = client_for(token_server.address)
    try:
        err = rpc_error(c.call, 0, "Status", pb.StatusRequest())
        assert err.code == grpc.StatusCode.UNAUTHENTICATED
        assert "Status" in err.details and "'read'" in err.details
        err = rpc_error(c.register_buffer, "j", "w", 8, optimizer="sgd")
        assert err.code == grpc.StatusCode.UNAUTHENTICATED
        assert "RegisterBuffer" in err.details and "'train'" in err.details
    finally:
        c.close()


def test_unknown_or_malformed_token_is_unauthenticated(token_server: ShardServer) -> None:
    c = client_for(token_server.address, token="guess")
    try:
        err = rpc_error(c.call, 0, "Status", pb.StatusRequest())
        assert err.code == grpc.StatusCode.UNAUTHENTICATED
        assert "unknown bearer token" in err.details
    finally:
        c.close()
    with grpc.insecure_channel(token_server.address) as chan:
        status = chan.unary_unary(f"/{SERVICE_NAME}/Status")
        with pytest.raises(grpc.RpcError) as info:  # the right secret, the wrong scheme
            status(b"", timeout=5, metadata=(("authorization", "Basic reader-secret"),))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "Bearer" in info.value.details()
        reply = status(b"", timeout=5, metadata=(("authorization", "bearer  reader-secret"),))
        assert pb.StatusReply.FromString(reply).pid == os.getpid()


def test_health_and_reflection_stay_open(token_server: ShardServer) -> None:
    with grpc.insecure_channel(token_server.address) as chan:
        reply = health_pb2_grpc.HealthStub(chan).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase,
        )

        assert SERVICE_NAME in set(ProtoReflectionDescriptorDatabase(chan).get_services())


def test_read_token_reads_but_cannot_train(token_server: ShardServer) -> None:
    trainer = client_for(token_server.address, token="trainer-secret")
    reader = client_for(token_server.address, token="reader-secret")
    n = 32
    try:
        trainer.register_buffer("job", "w", n, optimizer="sgd", hyper={"lr": 1.0})
        trainer.set_params("job", "w", np.arange(n, dtype=np.float32))
        before = reader.status()[0]["jobs"][0]["buffers"][0]
        np.testing.assert_array_equal(reader.pull_params("job", "w", n), np.arange(n))

        err = rpc_error(reader.push_grads, "job", "w", np.ones(n, np.float32), step=0)
        assert err.code == grpc.StatusCode.PERMISSION_DENIED
        assert "PushGrad" in err.details and "'train'" in err.details and "'read'" in err.details
        for fn, args in (
            (reader.set_params, ("job", "w", np.zeros(n, np.float32))),
            (reader.step, ("job", 0, {"w": StepArgs({"lr": 1.0})})),
            (reader.register_buffer, ("job", "other", 4)),
        ):
            assert rpc_error(fn, *args).code == grpc.StatusCode.PERMISSION_DENIED
        assert rpc_error(reader.all_reduce, np.ones(3)).code == grpc.StatusCode.PERMISSION_DENIED

        # nothing changed: same version, no gradient accumulated, same values
        after = reader.status()[0]["jobs"][0]["buffers"][0]
        assert after == before
        assert int(after["grad_bytes"]) == 0 and int(after["version"]) == 0
        np.testing.assert_array_equal(reader.pull_params("job", "w", n), np.arange(n))
        buf = token_server.servicer.buffers.get("job", "w")
        assert buf.grad is None and buf.pending is None
    finally:
        trainer.close()
        reader.close()


def test_train_token_trains_but_cannot_drop(token_server: ShardServer) -> None:
    trainer = client_for(token_server.address, token="trainer-secret")
    try:
        np.testing.assert_array_equal(train_one_step(trainer, "t"), np.zeros(64, np.float32))
        np.testing.assert_array_equal(trainer.all_reduce(np.arange(4.0)), np.arange(4.0))
        err = rpc_error(trainer.call, 0, "DropJob", pb.DropJobRequest(job="t"))
        assert err.code == grpc.StatusCode.PERMISSION_DENIED
        assert "DropJob needs role 'admin'" in err.details
        assert token_server.servicer.buffers.jobs().keys() == {"t"}
    finally:
        trainer.close()


def test_admin_token_can_do_everything(token_server: ShardServer) -> None:
    admin = client_for(token_server.address, token="admin-secret")
    try:
        train_one_step(admin, "a")
        assert admin.call(0, "DropJob", pb.DropJobRequest(job="a")).buffers == 1
        assert not token_server.servicer.buffers.jobs()
    finally:
        admin.close()


def test_role_table() -> None:
    served = [m.name for m in pb.DESCRIPTOR.services_by_name["Shard"].methods]
    for method in served:  # every method has a role; unlisted ones default to admin
        assert auth.required_role(f"/{SERVICE_NAME}/{method}") in tokens.ROLES
    expected = {
        "Status": "read",
        "PullParams": "read",
        "RegisterBuffer": "train",
        "SetParams": "train",
        "PushGrad": "train",
        "GradNorm": "train",
        "Step": "train",
        "Contribute": "train",
        "ReadSlot": "train",
        "DropJob": "admin",
    }
    for method, role in expected.items():
        assert auth.required_role(f"/{SERVICE_NAME}/{method}") == role
    for method in ("SnapshotNow", "RestoreJob", "ReplicaSync", "Shutdown", "NoSuchMethod"):
        assert auth.required_role(f"/{SERVICE_NAME}/{method}") == "admin"
    assert auth.required_role("/grpc.health.v1.Health/Check") is None
    assert auth.required_role("/grpc.reflection.v1alpha.ServerReflection/Info") is None
    assert auth.required_role("/some.other.Service/Anything") == "admin"
    assert auth.role_allows("admin", "read") and auth.role_allows("train", "train")
    assert not auth.role_allows("read", "train") and not auth.role_allows("train", "admin")


def test_token_file_parsing() -> None:
    text = "# roles\n\nread r-1\ntrain  t-1 \nadmin a-1\nread r-1\n"
    assert tokens.parse_token_file(text) == {"r-1": "read", "t-1": "train", "a-1": "admin"}
    for bad, match in (
        ("root x\n", "unknown role 'root'"),
        ("read\n", "expected 'ROLE TOKEN'"),
        ("read a b\n", "expected 'ROLE TOKEN'"),
        ("read x\nadmin x\n", "same token"),
        ("# nothing\n", "no tokens"),
    ):
        with pytest.raises(ValueError, match=match):
            tokens.parse_token_file(bad, "f")
    with pytest.raises(ValueError, match="unknown role"):
        ShardServer(tokens={"x": "superuser"})


# -------------------------------------------------------------------------------------- binding
def test_server_refuses_public_host_without_protection(pki: Pki) -> None:
    with pytest.raises(ValueError, match="refusing to listen on '0.0.0.0'"):
        ShardServer("0.0.0.0")
    for kw in (
        {"tokens": {"t": "train"}},
        {"tls_cert": pki.server_cert, "tls_key": pki.server_key},
        {"insecure": True},
    ):
        s = ShardServer("0.0.0.0", **kw)  # type: ignore[arg-type]
        assert s.exposed == ("insecure" in kw)
        s.stop(0)
    ShardServer("localhost").stop(0)
