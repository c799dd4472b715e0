"""The multi-host lab: network namespaces on one bridge (benchmarks/_netns.py) and processes
inside them.

``netlab`` (module scope) builds host namespaces ``s0``, ``s1`` (shard servers) and ``t0``,
``t1`` (trainers), each with ``eth0`` = 10.231.X.k/24 on a private bridge. Only addresses inside
these namespaces are ever used. Teardown (also after a failure or an error halfway through the
setup) stops every process the lab started, kills whatever is still inside its namespaces, and
deletes the namespaces (which removes the veths and the bridge).

The whole directory is skipped, with the reason, when not root, when ``ip`` is missing or when
``ip netns add`` fails.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from benchmarks._netns import Namespaces, unavailable

ROOT = Path(__file__).resolve().parents[2]
PORT = 50051


class Proc:
    """A process the lab started (in a namespace), its output kept in memory and in a file."""

    def __init__(self, name: str, cmd: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        self.lines: list[str] = []
        self._queue: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.proc = subprocess.Popen(
            list(cmd),
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: stopped by that id, nothing else
        )
        self._reader = threading.Thread(target=self._read, name=f"read {name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log, "a", encoding="utf-8") as f:
            for line in iter(self.proc.stdout.readline, ""):
                self.lines.append(line.rstrip("\n"))
                self._queue.put(line)
                f.write(line)
                f.flush()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for_line(self, needle: str, timeout: float) -> str:
        """Returns the first new output line containing ``needle`` (bounded by ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no line with {needle!r} in {timeout:g} s")
            try:
                line = self._queue.get(timeout=min(left, 0.2))
            except queue.Empty:
                if not self.alive() and self._queue.empty():
                    self._reader.join(2)
                    if self._queue.empty():
                        raise RuntimeError(
                            f"{self.name} exited ({self.proc.returncode}) before {needle!r}:\n"
                            + self.output()
                        ) from None
                continue
            if needle in line:
                return line

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self.name} still running after {timeout:g} s") from None
        self._reader.join(5)
        return code

    def output(self, last: int = 60) -> str:
        return "\n".join(self.lines[-last:])

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL this process only (the server itself: `ip netns exec` execs it, same pid)."""
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, grace: float = 10.0) -> None:
        if self.alive():
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._reader.join(5)


class NetLab(Namespaces):
    """The namespaces, their addresses and the processes started in them."""

    def __init__(self, workdir: Path, hosts: Sequence[str]) -> None:
        super().__init__(hosts)
        self.workdir = workdir
        self.procs: list[Proc] = []

    def teardown(self) -> None:
        for p in self.procs:
            try:
                p.stop(grace=5)
            except Exception as exc:  # noqa: BLE001 - keep tearing down the rest
                print(f"netlab: stopping {p.name} failed: {exc}", file=sys.stderr)
        super().teardown()

    # ------------------------------------------------------------------ processes
    def env(self, **extra: str) -> dict[str, str]:
        from paramshard.server.app import MALLOC_ENV

        # Namespaces share /dev/shm and memory: a trainer and a server in two of them could
        # share segments if the abstract socket were reachable. It is not (abstract sockets are
        # per network namespace), but the in-band path is what these hosts test: forced off.
        env = {**MALLOC_ENV, **os.environ, "PYTHONUNBUFFERED": "1", "PARAMSHARD_SHM": "0", **extra}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        for var in ("PARAMSHARD_SERVERS", "PARAMSHARD_RUN", "RANK", "WORLD_SIZE"):
            env.pop(var, None)
        return env

    def run_in(self, host: str, name: str, cmd: Sequence[str], **env: str) -> Proc:
        """Starts ``cmd`` inside ``host``'s namespace (``ip netns exec`` execs it: same pid)."""
        proc = Proc(
            name,
            [*self.exec_prefix(host), *cmd],
            self.env(**env),
            self.workdir / f"{len(self.procs):02d}-{name}.log",
        )
        self.procs.append(proc)
        return proc

    def address(self, host: str) -> str:
        return f"{self.ip[host]}:{PORT}"


@pytest.fixture(scope="module")
def netlab(tmp_path_factory: pytest.TempPathFactory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    lab = NetLab(tmp_path_factory.mktemp("netlab"), ["s0", "s1", "t0", "t1"])
    try:
        lab.build()
        yield lab
    finally:
        lab.teardown()
