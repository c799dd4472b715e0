"""docs/design.md §6.1: TLS, mutual TLS, bearer tokens with roles, and the binding rule.

Certificates are made per session with ``cryptography``: a CA, a server certificate for
127.0.0.1 / localhost, a client certificate, and a second CA standing for an impostor.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramshard.client import ClusterSpec, ShardClient, StepArgs
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb
from paramshard.server import MALLOC_ENV, ShardServer
from paramshard.server.rpc import auth, tokens
from paramshard.server.servicer import SERVICE_NAME

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)

TOKENS = {"reader-secret": "read", "trainer-secret": "train", "admin-secret": "admin"}


# ---------------------------------------------------------------------------------- certificates
@dataclass
class Pki:
    ca: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes
    client_key: bytes
    other_ca: bytes
    other_client_cert: bytes
    other_client_key: bytes


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    cn: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    *,
    server: bool,
) -> tuple[bytes, bytes]:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


@pytest.fixture(scope="session")
def pki() -> Pki:
    ca = _ca("paramshard test CA")
    other = _ca("impostor CA")
    server_cert, server_key = _leaf("shard server", ca, server=True)
    client_cert, client_key = _leaf("trainer", ca, server=False)
    other_cert, other_key = _leaf("impostor", other, server=False)
    pem = serialization.Encoding.PEM
    return Pki(
        ca=ca[0].public_bytes(pem),
        server_cert=server_cert,
        server_key=server_key,
        client_cert=client_cert,
        client_key=client_key,
        other_ca=other[0].public_bytes(pem),
        other_client_cert=other_cert,
        other_client_key=other_key,
    )


@pytest.fixture
def pki_files(pki: Pki, tmp_path: Path) -> dict[str, Path]:
    files = {
        "ca": pki.ca,
        "cert": pki.server_cert,
        "key": pki.server_key,
    }
    out = {}
    for name, data in files.items():
        path = tmp_path / f"{name}.pem"
        path.write_bytes(data)
        path.chmod(0o600)
        out[name] = path
    return out


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


# ------------------------------------------------------------------------------------------ CLI
LISTENING = re.compile(r"^paramshard serve: listening on (\S+) \(device (\S+), pid (\d+)\)$")


def cli_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in MALLOC_ENV and not k.startswith("PARAMSHARD_")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "paramshard", *args],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
        check=False,
    )


class Serve:
    """``paramshard serve ARGS`` in the background; the first stdout line is awaited."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "paramshard", "serve", *args],
            cwd=ROOT,
            env=cli_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self.readers = [
            threading.Thread(target=self._read, args=(stream, sink), daemon=True)
            for stream, sink in (
                (self.proc.stdout, self.lines.put),
                (self.proc.stderr, self.stderr.append),
            )
        ]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, sink) -> None:  # noqa: ANN001
        for line in stream:
            sink(line.rstrip("\n"))

    def port(self) -> int:
        try:
            line = self.lines.get(timeout=20)
        except queue.Empty:
            pytest.fail(f"serve printed nothing within 20 s; stderr: {self.stderr}")
        match = LISTENING.match(line)
        assert match, f"{line!r}; stderr: {self.stderr}"
        return int(match.group(1).rsplit(":", 1)[1])

    def __enter__(self) -> Serve:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for reader in self.readers:
            reader.join(5)


def test_serve_public_host_needs_tls_token_or_insecure() -> None:
    result = run_cli("serve", "--host", "0.0.0.0", "--port", "0")
    assert result.returncode == 2
    assert "--insecure" in result.stderr and "--token-file" in result.stderr
    assert "--tls-cert" in result.stderr
    assert "Traceback" not in result.stderr and "listening" not in result.stdout


def test_serve_with_token_file_on_public_host(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("read r-secret\ntrain t-secret\n")
    tokens.chmod(0o600)
    with Serve("--host", "0.0.0.0", "--port", "0", "--token-file", str(tokens)) as serve:
        address = f"127.0.0.1:{serve.port()}"
        anonymous = client_for(address)
        trainer = client_for(address, token="t-secret")
        try:
            err = rpc_error(anonymous.call, 0, "Status", pb.StatusRequest())
            assert err.code == grpc.StatusCode.UNAUTHENTICATED
            np.testing.assert_array_equal(train_one_step(trainer, "cli"), np.zeros(64))
        finally:
            anonymous.close()
            trainer.close()
        health = run_cli("health", address)  # health stays open
        assert health.returncode == 0, health.stderr
    assert any("tokens but no TLS" in line for line in serve.stderr), serve.stderr


def test_serve_with_tls_files(pki: Pki, pki_files: dict[str, Path]) -> None:
    args = ["--tls-cert", str(pki_files["cert"]), "--tls-key", str(pki_files["key"])]
    args += ["--tls-ca", str(pki_files["ca"])]
    with Serve("--host", "0.0.0.0", "--port", "0", *args) as serve:
        address = f"127.0.0.1:{serve.port()}"
        good = client_for(address, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key)
        plain = client_for(address)
        try:
            assert "error" not in good.status()[0]
            assert rpc_error(plain.call, 0, "Status", pb.StatusRequest()).code == (
                grpc.StatusCode.UNAVAILABLE
            )
        finally:
            good.close()
            plain.close()
    assert not any("Traceback" in line for line in serve.stderr), serve.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls-cert", "x.pem"], "--tls-cert and --tls-key go together"),
        (["--token-file", "/nonexistent/tokens"], "--token-file"),
    ],
)
def test_serve_bad_security_flags_exit_2(args: list[str], message: str) -> None:
    result = run_cli("serve", "--port", "0", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_bad_token_file_exits_2(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("superuser abc\n")
    result = run_cli("serve", "--port", "0", "--token-file", str(tokens))
    assert result.returncode == 2
    assert "line 1: unknown role 'superuser'" in result.stderr
