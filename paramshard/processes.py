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
from typing import IO

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


_ON_PARENT_DEATH = (
    "import ctypes, os, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    try:\n"
    "        ctypes.CDLL('libc.so.6').prctl(1, 15)\n"  # PR_SET_PDEATHSIG, SIGTERM
    "    except OSError:\n"
    "        pass\n"
    "    if os.getppid() != int(sys.argv[1]):\n"  # the launcher died before the prctl
    "        sys.exit(143)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def parent_death_signal(cmd: Sequence[str]) -> list[str]:
    """``cmd`` run so that it gets SIGTERM when the launcher dies, even by SIGKILL (Linux), and
    no server or rank outlives it: a short interpreter sets the signal and execs ``cmd``, which
    keeps it. Not a ``preexec_fn``: that makes ``subprocess`` fork this process, and the fork
    runs gRPC's fork handlers in the child, which wait on locks the launcher's gRPC threads
    may hold (a rank that never started, or died with grpc's ``epoll_wait`` error before its
    exec); without one, ``subprocess`` uses vfork, which runs no handlers."""
    return [sys.executable, "-I", "-S", "-c", _ON_PARENT_DEATH, str(os.getpid()), *cmd]


def spawn(name: str, cmd: list[str], env: dict[str, str]) -> Child:
    proc = subprocess.Popen(
        parent_death_signal(cmd),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # Ctrl-C reaches only the launcher, which forwards it
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
    ``signum`` is followed by SIGCONT (as systemd does): a child stopped by SIGSTOP or a
    debugger takes a signal only once it runs, and would otherwise wait out the grace.

    A signal arriving meanwhile (``received`` grows: a second Ctrl-C) ends the wait at once."""
    already = len(received)
    for child in children:
        child.signal(signum)
        if signum != signal.SIGKILL:
            child.signal(signal.SIGCONT)
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
