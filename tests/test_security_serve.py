"""``paramshard serve``'s security flags (docs/design.md §6.1): a public host needs TLS, a
token file or ``--insecure``; token files and TLS files as given on the command line; bad
flags and files exit 2 with a message. Each server runs as a subprocess (test_cli.py's
``ServeProcess``)."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
from test_cli import ServeProcess, paramshard
from test_security import Pki, client_for, rpc_error, train_one_step

from paramshard.protos import shard_pb2 as pb

pytestmark = pytest.mark.timeout(120)


def test_serve_public_host_needs_tls_token_or_insecure() -> None:
    result = paramshard("serve", "--host", "0.0.0.0", "--port", "0")
    assert result.returncode == 2
    assert "--insecure" in result.stderr and "--token-file" in result.stderr
    assert "--tls-cert" in result.stderr
    assert "Traceback" not in result.stderr and "listening" not in result.stdout


def test_serve_with_token_file_on_public_host(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("read r-secret\ntrain t-secret\n")
    tokens.chmod(0o600)
    with ServeProcess("--host", "0.0.0.0", "--port", "0", "--token-file", str(tokens)) as serve:
        address = serve.loopback()
        anonymous = client_for(address)
        trainer = client_for(address, token="t-secret")
        try:
            err = rpc_error(anonymous.call, 0, "Status", pb.StatusRequest())
            assert err.code == grpc.StatusCode.UNAUTHENTICATED
            np.testing.assert_array_equal(train_one_step(trainer, "cli"), np.zeros(64))
        finally:
            anonymous.close()
            trainer.close()
        health = paramshard("health", address)  # health stays open
        assert health.returncode == 0, health.stderr
    assert any("tokens but no TLS" in line for line in serve.stderr), serve.stderr


def test_serve_with_tls_files(pki: Pki, pki_files: dict[str, Path]) -> None:
    args = ["--tls-cert", str(pki_files["cert"]), "--tls-key", str(pki_files["key"])]
    args += ["--tls-ca", str(pki_files["ca"])]
    with ServeProcess("--host", "0.0.0.0", "--port", "0", *args) as serve:
        address = serve.loopback()
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
    result = paramshard("serve", "--port", "0", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_bad_token_file_exits_2(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("superuser abc\n")
    result = paramshard("serve", "--port", "0", "--token-file", str(tokens))
    assert result.returncode == 2
    assert "line 1: unknown role 'superuser'" in result.stderr
