"""The ``paramshard`` command line: serve (as a real process), health, status.

``serve`` runs as a subprocess the way users start it, so the MALLOC_* re-exec, the listening
line, signal handling and exit codes are the real ones. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from paramshard import cli, commands, serve_setup
from paramshard.client import ClusterSpec, ShardClient
from paramshard.server import MALLOC_ENV

ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"^paramshard serve: listening on (\S+) \(device (\S+), pid (\d+)\)$")
START_S = 20.0  # generous: a loaded CI machine imports grpc + numpy slowly
pytestmark = pytest.mark.timeout(120)


def cli_env(**extra: str) -> dict[str, str]:
    """The test's environment without MALLOC_* (so serve must re-exec), this checkout first."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in MALLOC_ENV and not k.startswith("PARAMSHARD_")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def paramshard(*args: str, timeout: float = 30.0, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "paramshard", *args],
        cwd=ROOT,
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


class ServeProcess:
    """``paramshard serve ARGS`` in the background, its output collected by reader threads."""

    def __init__(self, *args: str, **env: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "paramshard", "serve", *args],
            cwd=ROOT,
            env=cli_env(**env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self.readers = [
            threading.Thread(
                target=self._read, args=(self.proc.stdout, self.stdout.put), daemon=True
            ),
            threading.Thread(
                target=self._read, args=(self.proc.stderr, self.stderr.append), daemon=True
            ),
        ]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, sink) -> None:  # noqa: ANN001
        for line in stream:
            sink(line.rstrip("\n"))

    def wait_listening(self) -> tuple[str, int]:
        """(address, pid) from the listening line; fails if it does not come within START_S."""
        try:
            line = self.stdout.get(timeout=START_S)
        except queue.Empty:
            self.stop()
            pytest.fail(f"no listening line within {START_S} s; stderr: {self.stderr}")
        match = LISTENING.match(line)
        assert match, f"unexpected first line {line!r}; stderr: {self.stderr}"
        return match.group(1), int(match.group(3))

    def output_after_exit(self, timeout: float = 5.0) -> list[str]:
        """The remaining stdout lines, once the process has exited and both pipes are drained."""
        for reader in self.readers:
            reader.join(timeout)
        lines = []
        while not self.stdout.empty():
            lines.append(self.stdout.get_nowait())
        return lines

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def loopback(self) -> str:
        """127.0.0.1 at the port of the listening line (a server on 0.0.0.0 listens there)."""
        address, _ = self.wait_listening()
        return f"127.0.0.1:{address.rsplit(':', 1)[1]}"

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        """Stopped, and its output read to the end (``stderr`` then holds every line)."""
        self.stop()
        self.output_after_exit()


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def dead_address() -> str:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def cuda_available() -> bool:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU"
        return False


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, int]]:
    """One ``paramshard serve --port 0`` for the module: (address, pid)."""
    server = ServeProcess("--port", "0")
    try:
        yield server.wait_listening()
    finally:
        server.stop()


# ------------------------------------------------------------------------------------- serve
needs_proc = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")


@needs_proc
def test_serve_reexecs_with_malloc_env(served: tuple[str, int]) -> None:
    address, pid = served
    assert re.fullmatch(r"127\.0\.0\.1:\d+", address) and not address.endswith(":0")
    env = environ_of(pid)  # the environment the interpreter started with, after the re-exec
    assert {k: env.get(k) for k in MALLOC_ENV} == MALLOC_ENV


@needs_proc
def test_serve_keeps_user_malloc_values_and_stops_on_sigterm() -> None:
    server = ServeProcess("--port", "0", "--grace", "1", MALLOC_ARENA_MAX="2")
    try:
        _, pid = server.wait_listening()
        assert pid == server.proc.pid  # execve keeps the pid: supervisors see one process
        env = environ_of(pid)
        assert env["MALLOC_ARENA_MAX"] == "2"
        assert env["MALLOC_MMAP_THRESHOLD_"] == MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=15) == 0
        assert any("stopped" in line for line in server.output_after_exit())
    finally:
        server.stop()
    assert not any("Traceback" in line for line in server.stderr), server.stderr


def test_serve_refuses_public_host_without_insecure() -> None:
    result = paramshard("serve", "--host", "0.0.0.0", "--port", "0")
    assert result.returncode == 2
    assert "--insecure" in result.stderr
    assert "read or overwrite" in result.stderr
    assert "Traceback" not in result.stderr
    assert "listening" not in result.stdout


@pytest.mark.skipif(cuda_available(), reason="CUDA is available here")
def test_serve_cuda_without_cuda_is_a_clear_error() -> None:
    result = paramshard("serve", "--port", "0", "--device", "cuda:0")
    assert result.returncode == 2
    assert "paramshard serve: error: device 'cuda:0'" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_on_a_taken_port_says_so_in_one_line() -> None:
    """grpc's C core logged its own ``add_port.cc`` lines before our message."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = paramshard("serve", "--port", str(port))
    assert result.returncode == 1, result.stderr
    said = f"paramshard serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert result.stderr.strip() == said, result.stderr


def test_serve_rejects_bad_port() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--port", "70000"])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["serve", "--port", "abc"], "argument --port: 'abc' is not a port number"),
        (["serve", "--grace", "soon"], "argument --grace: 'soon' is not a number >= 0"),
        (["launch", "--nproc", "two", "x.py"], "argument --nproc: 'two' is not an integer >= 1"),
    ],
)
def test_a_value_that_is_no_number_is_named_in_words(argv, said, capsys) -> None:
    """argparse's own message names the type function ("invalid positive_int value")."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "invalid" not in err, err


@pytest.mark.parametrize(
    ("argv", "usage", "said"),
    [
        (
            ["--nope"],
            "usage: paramshard [",
            "unrecognized arguments: --nope (a COMMAND comes first:",
        ),
        (
            [],
            "usage: paramshard [",
            "a COMMAND is required: one of delete-snapshot, drop, export, get, health",
        ),
        (["health", "--server", "x:1"], "usage: paramshard health", "arguments: --server"),
        (["status", "--bogus"], "usage: paramshard status", "unrecognized arguments: --bogus"),
    ],
)
def test_an_unknown_option_is_named_with_its_commands_usage(argv, usage, said, capsys) -> None:
    """argparse said only "the following arguments are required: COMMAND" for an unknown
    option given without a command, and showed the top-level usage for one given to a
    command. ``health`` exits 1 for it as for any failure (Docker reserves 2)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == (1 if argv[:1] == ["health"] else 2)
    err = capsys.readouterr().err
    assert err.startswith(usage) and said in err, err


def test_launch_says_a_bad_servers_address_before_anything_else(tmp_path: Path, capsys) -> None:
    """Its OMP_NUM_THREADS notice came first, then the usage error."""
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "environ", env)
        code = cli.main(["launch", "--nproc", "2", "--servers", "bad", str(script)])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err == "paramshard launch: error: server address 'bad' is not host:port\n"
    assert captured.out == ""


# ------------------------------------------------------------------------------------ health
def test_health_serving(served: tuple[str, int]) -> None:
    result = paramshard("health", served[0])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{served[0]}: SERVING"


def test_health_dead_server_exits_1() -> None:
    address = dead_address()
    result = paramshard("health", address, "--timeout", "2")
    assert result.returncode == 1
    assert f"paramshard health: error: {address}: UNAVAILABLE" in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------------------ status
def test_status_json(served: tuple[str, int]) -> None:
    address, pid = served
    result = paramshard("status", "--servers", address, "--json")
    assert result.returncode == 0, result.stderr
    (reply,) = json.loads(result.stdout)
    assert reply["address"] == address
    assert "error" not in reply
    assert reply["device"] == "cpu"
    assert int(reply["pid"]) == pid


def test_status_from_env_with_dead_server(served: tuple[str, int]) -> None:
    dead = dead_address()
    result = paramshard("status", PARAMSHARD_SERVERS=f"{served[0]},{dead}")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    header, ok_row, error_row, detail = result.stdout.splitlines()
    assert header.split()[:3] == ["SERVER", "HEALTH", "DEVICE"]
    assert ok_row.split()[:3] == [served[0], "ok", "cpu"]
    assert error_row.split()[:2] == [dead, "error"]
    assert detail.startswith(f"{dead}: UNAVAILABLE")


def test_status_without_servers_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.delenv("PARAMSHARD_SERVERS", raising=False)
    assert cli.main(["status"]) == 2
    assert "PARAMSHARD_SERVERS" in capsys.readouterr().err


def test_status_table_sums_buffers(servers, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    addresses = [s.address for s in servers(2)]
    client = ShardClient(ClusterSpec(addresses), timeout_s=10.0)
    try:
        client.register_buffer("job-a", "w", 1000, optimizer="sgd")
        client.set_params("job-a", "w", np.ones(1000, np.float32), version=7)
        client.register_buffer("job-b", "w", 10, optimizer="sgd")
        replies = client.status()
    finally:
        client.close()
    assert cli.main(["status", "--servers", ",".join(addresses)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    for line, reply in zip(lines[1:], replies, strict=True):
        cells = re.split(r"\s{2,}", line.strip())
        # server, health, device, jobs, buffers, max version
        assert cells[:6] == [reply["address"], "ok", "cpu", "2", "2", "7"]
        param_bytes = sum(int(b["param_bytes"]) for j in reply["jobs"] for b in j["buffers"])
        assert param_bytes >= 505 * 4  # each server holds about half of 1000 + 10 float32
        assert cells[6] == commands.human_bytes(param_bytes)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.0.1", True),
        ("::1", True),
        ("[::1]", True),  # as an address writes it; the CLI's own copy of the rule said False
        ("localhost", True),
        ("0.0.0.0", False),
        ("", False),
        ("::", False),
        ("10.0.0.5", False),
        ("example.com", False),
    ],
)
def test_loopback_rule(host: str, loopback: bool) -> None:
    assert serve_setup.is_loopback(host) is loopback


def test_console_script_entry_point() -> None:
    script = Path(sys.executable).with_name("paramshard")
    if not script.exists():
        pytest.skip("paramshard is not installed in this environment (pip install -e .)")
    result = subprocess.run(
        [str(script), "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0
    assert result.stdout.strip().startswith("paramshard ")
