"""Issue 26, requirement 4: a server that cannot be reached is refused within seconds, named
with its address and the cause, by a rank's first call and by ``paramshard launch --servers``
(it used to wait 60 s in silence and say DEADLINE_EXCEEDED).

Causes: nothing listens on the port (connection refused), a host name that does not resolve,
a TLS handshake that fails (a plain server asked for TLS, the wrong CA, a certificate for
another name, a TLS server asked without it), a port where something else answers (a web
server, not gRPC) and a token the server does not know. TLS servers use the test PKI
(tests/pki.py); every server is real, on 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from pki import make_pki

from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.client.unreachable import explain
from paramshard.commands import CommandError
from paramshard.local_servers import CONNECT_GRACE_S, wait_serving
from paramshard.protos import shard_pb2 as pb
from paramshard.server import MALLOC_ENV, ShardServer

ROOT = Path(__file__).resolve().parents[1]
FEW_S = 8.0
"""A refusal comes within this: the client's retries (about 2 s in all) or launch's grace
(``CONNECT_GRACE_S``), on a loaded machine."""


@pytest.fixture(scope="module")
def pki() -> dict[str, bytes]:
    return make_pki({"server": ("paramshard server", ["localhost"])})


@pytest.fixture(scope="module")
def other_pki() -> dict[str, bytes]:
    return make_pki({"server": ("someone else", [])})


@pytest.fixture(scope="module")
def tls_server(pki: dict[str, bytes]) -> Iterator[str]:
    with ShardServer("127.0.0.1", 0, tls_cert=pki["server"], tls_key=pki["server_key"]) as s:
        yield s.address


@pytest.fixture(scope="module")
def plain_server() -> Iterator[str]:
    with ShardServer("127.0.0.1", 0, local_calls=False) as s:
        yield s.address


@pytest.fixture(scope="module")
def token_server() -> Iterator[str]:
    with ShardServer("127.0.0.1", 0, tokens={"the-token": "train"}) as s:
        yield s.address


@pytest.fixture(scope="module")
def http_port() -> Iterator[str]:
    """A port where a web server answers: every connection gets an HTTP/1.1 reply and is closed
    (what grpc reads as a first frame of the wrong type)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    done = threading.Event()

    def answer() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        done.set()
        thread.join(5)
        listener.close()


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def cases(pki: dict[str, bytes], other: dict[str, bytes], addresses: dict[str, str]) -> dict:
    """name -> (address, ClusterSpec keywords, words the error must hold)."""
    return {
        "refused": (closed_port(), {}, "connection refused"),
        "dns": ("no-such-host.invalid:50051", {}, "DNS failure"),
        "TLS to a plain server": (
            addresses["plain"], {"tls_ca": pki["ca"]}, "the server does not speak TLS",
        ),
        "wrong CA": (
            addresses["tls"], {"tls_ca": other["ca"]}, "not signed by the CA given",
        ),
        "another name": (
            addresses["tls"], {"tls_ca": pki["ca"], "tls_server_name": "elsewhere"},
            "does not name this address",
        ),
        "plain to a TLS server": (addresses["tls"], {}, "it requires TLS"),
        "bad token": (addresses["token"], {"token": "wrong"}, "refused the credentials"),
        "not gRPC": (addresses["http"], {}, "the port answers, but not in gRPC"),
    }  # fmt: skip


@pytest.fixture(scope="module")
def all_cases(
    pki: dict[str, bytes],
    other_pki: dict[str, bytes],
    tls_server: str,
    plain_server: str,
    token_server: str,
    http_port: str,
) -> dict[str, Any]:
    addresses = {"tls": tls_server, "plain": plain_server, "token": token_server, "http": http_port}
    return cases(pki, other_pki, addresses)


CASES = [
    "refused",
    "dns",
    "TLS to a plain server",
    "wrong CA",
    "another name",
    "plain to a TLS server",
    "bad token",
    "not gRPC",
]


@pytest.mark.parametrize("name", CASES)
def test_a_ranks_first_call_names_address_and_cause(name: str, all_cases: dict) -> None:
    address, spec, words = all_cases[name]
    client = ShardClient(ClusterSpec([address], **spec), rank=0, world_size=1)  # default 120 s
    began = time.monotonic()
    try:
        with pytest.raises(ShardClientError) as info:
            client.register_buffer("job", "w", 8)
    finally:
        client.close()
    took = time.monotonic() - began
    assert took < FEW_S, f"{name}: refused after {took:.1f} s"
    assert address in str(info.value) and words in info.value.details, info.value


@pytest.mark.parametrize("name", CASES)
def test_launch_servers_names_address_and_cause(
    name: str, all_cases: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wait_serving`` is what ``paramshard launch --servers`` runs before any rank starts;
    TLS settings come from PARAMSHARD_TLS_* as the ranks' do."""
    address, spec, words = all_cases[name]
    for key in ("tls_ca", "tls_server_name"):
        var = f"PARAMSHARD_{key.upper()}"
        monkeypatch.delenv(var, raising=False)
        if key in spec:
            value = spec[key]
            if isinstance(value, bytes):
                (tmp_path / key).write_bytes(value)
                value = str(tmp_path / key)
            monkeypatch.setenv(var, value)
    began = time.monotonic()
    with pytest.raises(CommandError) as info:
        wait_serving([address], spec.get("token"), timeout=60.0)
    took = time.monotonic() - began
    assert took < CONNECT_GRACE_S + FEW_S, f"{name}: refused after {took:.1f} s"
    assert f"server {address}" in str(info.value) and words in str(info.value), info.value


def test_launch_servers_end_to_end_refused(tmp_path: Path) -> None:
    """The command itself: exit code 1 and one line naming the address and the cause, long
    before its 60 s --start-timeout."""
    address = closed_port()
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a rank must not start')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSHARD_")}
    env = {k: v for k, v in env.items() if k not in MALLOC_ENV}
    env["PARAMSHARD_RUN_DIR"] = str(tmp_path / "runs")
    began = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "paramshard", "launch", "--nproc", "1", "--servers", address,
         str(script)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    took = time.monotonic() - began
    assert out.returncode == 1, out.stderr
    assert f"server {address} is unreachable: connection refused" in out.stderr
    assert "a rank must not start" not in out.stderr
    assert took < 30.0, f"{took:.1f} s (the interpreter's start is most of it)"


def test_health_names_a_port_that_is_not_grpc(http_port: str) -> None:
    """``paramshard health`` (a container's HEALTHCHECK, a user's first try) says why too."""
    out = subprocess.run(
        [sys.executable, "-m", "paramshard", "health", http_port, "--timeout", "5"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert f"paramshard health: error: {http_port}: UNAVAILABLE: cannot reach" in out.stderr
    assert "not in gRPC" in out.stderr and "Traceback" not in out.stderr


def test_a_reachable_server_passes(token_server: str) -> None:
    """The right token: launch goes on (and the token check is a real call)."""
    wait_serving([token_server], "the-token", timeout=30.0)
    c = ShardClient(ClusterSpec([token_server], token="the-token"))
    try:
        assert c.call(0, "Status", pb.StatusRequest()).version
    finally:
        c.close()


def test_servers_starting_beside_the_trainers_are_awaited_when_asked() -> None:
    """``launch --servers ... --start-timeout T`` (docker/k8s: servers and trainers start
    together): a server that refuses connections at first is awaited, not refused."""
    address = closed_port()
    started: list[ShardServer] = []

    def start_late() -> None:
        time.sleep(CONNECT_GRACE_S + 2.0)  # past the default grace: only T keeps launch waiting
        started.append(ShardServer("127.0.0.1", int(address.rsplit(":", 1)[1])).start())

    late = threading.Thread(target=start_late)
    late.start()
    try:
        began = time.monotonic()
        wait_serving([address], None, 60.0, unreachable_s=60.0)
        assert time.monotonic() - began >= CONNECT_GRACE_S
    finally:
        late.join()
        for s in started:
            s.stop(0)


def test_a_call_the_servers_grpc_dropped_unrun_says_what_to_size() -> None:
    """gRPC's core ends a call no thread took up with a bare CANCELLED "CANCELLED"
    (tests/test_server_stall.py makes it so); a rank's error names the bounds that decide it.
    A CANCELLED with words of its own (the client's, a server's handler) keeps them."""
    said = explain("10.0.0.7:50051", grpc.StatusCode.CANCELLED, "CANCELLED")
    assert said.startswith("10.0.0.7:50051: the server dropped the call before any of its"), said
    assert "--max-pending-calls" in said and "--max-wait-s" in said and said.endswith("CANCELLED")
    own = "the client was closed"
    assert explain("10.0.0.7:50051", grpc.StatusCode.CANCELLED, own) == own
