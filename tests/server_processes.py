"""A real ``paramshard serve`` process that a test can SIGKILL and start again at the same
address (``ServerProcess``), and an ``on_step`` hook that does so mid-training (``killer``):
tests/test_recovery.py and the recovery suites that build on it."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from paramshard.local_servers import LISTENING

ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    """``python -m paramshard serve`` on a fixed port (so a restart keeps the address)."""

    def __init__(self, snapshot_dir: Path) -> None:
        self.port, self.snapshot_dir = 0, snapshot_dir  # the first start picks the port
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, *extra: str) -> list[str]:
        """Starts it (with ``extra`` arguments); returns what it printed until it listened."""
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paramshard",
                "serve",
                "--port",
                str(self.port),
                "--snapshot-dir",
                str(self.snapshot_dir),
                *extra,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 60
        said = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            said.append(line)
            found = LISTENING.search(line.encode())
            if found:  # the port the kernel gave it (a port picked beforehand may be taken)
                self.port = int(found.group(1).rsplit(b":", 1)[1])
                return said
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError(f"server on port {self.port} did not start: {''.join(said)[-2000:]}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def killer(server: ServerProcess, at: int):
    """An ``on_step`` that SIGKILLs ``server`` when step ``at`` begins and restarts it at its
    address on another thread; returns it, the event set at the kill and the restart times."""
    killed = threading.Event()
    restarted_after: list[float] = []

    def on_step(step: int) -> None:
        if step == at and not killed.is_set():
            killed.set()
            server.kill()
            began = time.monotonic()
            threading.Thread(
                target=lambda: (server.start(), restarted_after.append(time.monotonic() - began)),
                daemon=True,
            ).start()

    return on_step, killed, restarted_after
