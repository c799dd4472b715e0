"""The launcher's child processes: spawning (own session, SIGTERM when the launcher dies),
relaying their output line by line as ``[NAME] LINE``, watching them exit, and stopping them
(SIGTERM, a grace period, SIGKILL)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from paramshard.launch_files import append_line

__all__ = ["Child", "exit_code", "parent_death_signal", "relay", "say", "spawn", "stop", "watch"]

PIPE_DRAIN_S = 5.0  # output a process left in its pipes is relayed for at most this long

_print_lock = threading.Lock()


@dataclass(eq=False)  # compared and hashed by identity
class Child:
    """One process the launcher started: a rank or a server, with its output relays."""

    name: str  # "rank 3" or "server 1": the prefix of its lines
    proc: subprocess.Popen
    relays: list[threading.Thread] = field(default_factory=list)
    rank: int = -1  # a rank's global rank; -1 for a server

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int) -> None:
        """Signals the child's whole process group (its own workers too) while it runs."""
        if not self.alive():
            return
        try:
            os.killpg(self.proc.pid, signum)  # start_new_session: the group id is its pid
        except (ProcessLookupError, PermissionError):
            self.proc.send_signal(signum)

    def drain(self) -> None:
        for relay in self.relays:
            relay.join(PIPE_DRAIN_S)


def parent_death_signal() -> Any:
    """Linux: a preexec_fn making the child get SIGTERM when the launcher dies, even by SIGKILL,
    so no server or rank outlives it. libc is loaded before forking: the child makes one call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (ImportError, OSError):  # best effort; stopping the children is the main mechanism
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def spawn(name: str, cmd: list[str], env: dict[str, str]) -> Child:
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # Ctrl-C reaches only the launcher, which forwards it
        preexec_fn=parent_death_signal(),  # noqa: PLW1509 - one prctl call, nothing to lock
    )
    return Child(name, proc)


def emit(stream: IO[str], data: bytes) -> None:
    """Writes raw bytes (a child's line, whatever its encoding) to one of our streams."""
    with _print_lock:
        try:
            stream.flush()
            raw = getattr(stream, "buffer", None)
            if raw is None:
                stream.write(data.decode("utf-8", "replace"))
            else:
                raw.write(data)
                raw.flush()
        except (OSError, ValueError):  # our reader went away (`| head`): keep draining the child
            pass


def say(message: str) -> None:
    emit(sys.stderr, f"paramshard launch: {message}\n".encode())


def relay(
    child: Child,
    pipe: IO[bytes],
    dest: IO[str] | None,
    lines: queue.SimpleQueue | None,
    log: IO[bytes] | None = None,
) -> None:
    """Copies ``pipe`` to ``dest`` line by line as ``[NAME] LINE`` (and to ``lines`` if given);
    ``log`` (a --log-dir file) gets the lines as they came, and is closed at the end. No
    ``dest`` (``--redirects``): the file alone."""
    prefix = f"[{child.name}] ".encode()

    def pump() -> None:
        for line in iter(pipe.readline, b""):
            if lines is not None:
                lines.put((child, line))
            if log is not None:
                append_line(log, line)
            if dest is not None:
                emit(dest, prefix + line.rstrip(b"\r\n") + b"\n")
        pipe.close()
        if log is not None:
            log.close()

    thread = threading.Thread(target=pump, name=f"relay {child.name}", daemon=True)
    thread.start()
    child.relays.append(thread)


def watch(child: Child, events: queue.SimpleQueue) -> None:
    """Puts ``("exit", child, code)`` once the child has exited and its output is relayed."""

    def wait() -> None:
        code = child.proc.wait()
        child.drain()
        events.put(("exit", child, code))

    threading.Thread(target=wait, name=f"watch {child.name}", daemon=True).start()


def stop(children: Sequence[Child], signum: int, grace: float, received: list[int]) -> None:
    """Sends ``signum``, waits up to ``grace`` seconds, then SIGKILLs whatever still runs.

    A signal arriving meanwhile (``received`` grows: a second Ctrl-C) ends the wait at once."""
    already = len(received)
    for child in children:
        child.signal(signum)
    deadline = time.monotonic() + grace
    while any(c.alive() for c in children) and time.monotonic() < deadline:
        if len(received) > already:
            break
        time.sleep(0.05)
    for child in children:
        if child.alive():
            say(f"{child.name} (pid {child.proc.pid}) still running: killing it")
            child.signal(signal.SIGKILL)
    for child in children:
        try:
            child.proc.wait(timeout=PIPE_DRAIN_S)
        except subprocess.TimeoutExpired:
            say(f"{child.name} (pid {child.proc.pid}) did not die")
        child.drain()


def exit_code(returncode: int) -> int:
    """A rank killed by signal S reports -S; a shell would say 128 + S."""
    return 128 - returncode if returncode < 0 else returncode
