"""``paramshard serve``'s security flags (docs/design.md §6.1): a public host needs TLS, a
token file or ``--insecure``; token files and TLS files as given on the command line; bad
flags and files exit 2 with a message. Each server runs as a subprocess."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_security import Pki, client_for, rpc_error, train_one_step

from paramshard.protos import shard_pb2 as pb
from paramshard.server import MALLOC_ENV

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


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
