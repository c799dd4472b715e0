"""ServerConfig (server/config.py): one typed, grouped config, checked once, for ShardServer and
``paramshard serve`` alike."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from paramshard.server import ServerConfig, ShardServer
from paramshard.server.config import BoundsConfig, CallLimits, SecurityConfig, as_flags


def test_keywords_go_to_their_groups() -> None:
    config = ServerConfig.from_options(
        port=0, max_memory="1GiB", max_workers=8, tokens={"t": "train"}, replica_ttl_s=5.0
    )
    assert config.bounds.max_memory == "1GiB" and config.bounds.replica_ttl_s == 5.0
    assert config.threads == CallLimits(workers=8, reserved=2)  # a quarter of the workers
    assert dict(config.security.tokens) == {"t": "train"}


def test_an_unknown_setting_is_named() -> None:
    with pytest.raises(TypeError, match="'max_memroy'"):
        ServerConfig.from_options(max_memroy="1GiB")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SecurityConfig(tls_key=b"-----BEGIN x"), "tls_cert and tls_key go together"),
        (lambda: SecurityConfig(tls_ca=b"-----BEGIN x"), "tls_ca needs the server's own tls_cert"),
        (lambda: SecurityConfig(peer_identities=("a",)), "need mutual TLS"),
        (lambda: SecurityConfig(tokens={"x": "superuser"}), "unknown role"),
        (lambda: BoundsConfig(max_wait_s=0), r"max_wait_s must be a number of seconds in \(0,"),
        (lambda: BoundsConfig(max_wait_s=float("inf")), r"max_wait_s must be .* got inf"),
        (lambda: BoundsConfig(max_receive_bytes=2**31), r"max_receive_bytes must be an int in"),
        (lambda: CallLimits(max_pending_calls=2**31), r"max_pending_calls must be an int in 1"),
        (lambda: BoundsConfig(max_memory="lots"), "lots"),
        (lambda: CallLimits(workers=4, reserved=4), "must be below workers"),
        (lambda: ServerConfig(port=70000), "port must be 0..65535"),
    ],
)
def test_bad_settings_are_refused_with_their_names(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_pem_files_are_read_and_checked(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    key.write_text("not a key")
    with pytest.raises(ValueError, match="tls_key is not PEM"):
        SecurityConfig(tls_cert=cert, tls_key=key)
    with pytest.raises(ValueError, match=f"tls_key: cannot read {tmp_path / 'missing'}"):
        SecurityConfig(tls_cert=cert, tls_key=tmp_path / "missing")


def test_config_or_settings_not_both() -> None:
    with pytest.raises(TypeError, match="not both"):
        ShardServer(config=ServerConfig(), max_memory="1GiB")


def test_a_server_runs_from_a_config() -> None:
    server = ShardServer(config=ServerConfig(bounds=BoundsConfig(max_memory="64MiB"))).start()
    try:
        assert server.servicer.budget.limit == 64 * 2**20
    finally:
        server.stop(0)


def test_messages_in_flags() -> None:
    assert as_flags("tls_ca needs the server's own tls_cert and tls_key") == (
        "--tls-ca needs the server's own --tls-cert and --tls-key"
    )
    assert as_flags("CallLimits.reserved (4) must be below workers (4)") == (
        "--reserved-workers (4) must be below --workers (4)"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls-ca", "ca.pem"], "--tls-ca needs the server's own --tls-cert and --tls-key"),
        (["--workers", "4", "--reserved-workers", "4"], "--reserved-workers (4) must be below"),
        (["--host", "0.0.0.0"], "or set --insecure on a network you trust"),
    ],
)
def test_serve_says_what_is_wrong_in_its_flags(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "paramshard", "serve", "--port", "0", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "1073741824",
             "MALLOC_TRIM_THRESHOLD_": "4294967296", "PATH": ""},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
