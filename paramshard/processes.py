"""The launcher's child processes: spawning (own session, SIGTERM when the launcher dies),
relaying their output line by line as ``[NAME] LINE``, watching them exit, and stopping them
(SIGTERM, a grace period, SIGKILL).

Each child leads a process group of its own (``start_new_session``), and stopping a child
stops its whole group: the processes it started (data loader workers, a background ``sleep``)
too, also when the child itself has already exited and left them behind.

Why a child is left unreaped until its group is stopped: ``killpg(pgid)`` is safe only while
``pgid`` names our group. Linux hands out no pid that is still in use as a process, group or
session id, and an unreaped child (a zombie) keeps its pid in use; so while the leader is
unreaped, no other process and no new group can get its number, and the group's signals reach
only processes started in it. Once the leader is reaped and the group's last process is gone,
the number may be reused (a new process calling ``setsid()`` gets it as its group id). So the
watcher learns of a child's exit with ``waitid(WNOWAIT)``, which leaves it a zombie; ``stop()``
signals the group, waits until no process of it runs (read from /proc), and only then reaps
the leader, after which the group is never signalled again. Where ``waitid`` or /proc is
missing (macOS), a child is reaped when it exits and its group is signalled only while it runs,
as before. A process that left the group (``setsid()``, a daemon) is not stopped."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from paramshard.launch_files import append_line
from paramshard.protos.words import printable

__all__ = ["Child", "exit_code", "parent_death_signal", "relay", "say", "spawn", "stop", "watch"]

PIPE_DRAIN_S = 5.0  # output a process left in its pipes is relayed for at most this long
QUIET_S = 0.25  # once a child exited: pipes silent this long are held open by what it left
_POLL_S = 0.05  # how often a stop looks whether the groups are gone
_WAITID = hasattr(os, "waitid") and hasattr(os, "WNOWAIT")  # Linux; not macOS

_print_lock = threading.Lock()


@dataclass(eq=False)  # compared and hashed by identity
class Child:
    """One process the launcher started: a rank or a server, with its output relays. It leads
    its own process group, whose id is its pid."""

    name: str  # "rank 3" or "server 1": the prefix of its lines
    proc: subprocess.Popen
    relays: list[threading.Thread] = field(default_factory=list)
    rank: int = -1  # a rank's global rank; -1 for a server
    last_output: float = 0.0  # time.monotonic() of the last line a relay handled
    last_error: str = ""  # the last line of its output that ended a traceback (``raised``)
    reaped: bool = False  # its pid may belong to another process now: never signal the group

    def alive(self) -> bool:
        """Whether the child itself runs (what it started may outlive it: ``group_running``)."""
        return self._status(block=False) is None

    def wait_exit(self) -> int:
        """Blocks until the child exits; its exit status as ``Popen.returncode`` gives it. The
        child stays unreaped (a zombie) where ``waitid`` exists, so its group id stays ours."""
        code = self._status(block=True)
        assert code is not None
        return code

    def _status(self, block: bool) -> int | None:
        """The child's exit status once it exited, else None; recorded in ``proc.returncode``
        (so ``Popen.poll()`` and ``Popen.wait()`` answer it and never reap the child: ``reap``
        does)."""
        if self.proc.returncode is not None:
            return self.proc.returncode
        if not _WAITID:
            code = self.proc.wait() if block else self.proc.poll()
            self.reaped = code is not None
            return code
        flags = os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG)
        try:
            info = os.waitid(os.P_PID, self.proc.pid, flags)
        except ChildProcessError:  # reaped by someone else: nothing says how it ended
            self.reaped = True
            return self.proc.returncode if self.proc.returncode is not None else -1
        if info is None:
            return None
        exited = info.si_code == os.CLD_EXITED
        self.proc.returncode = info.si_status if exited else -info.si_status
        return self.proc.returncode

    def group_running(self, live_groups: set[int] | None) -> bool:
        """Whether a process of the child's group runs: the child, or one it left behind.
        ``live_groups``: ``_live_groups()``, read once for many children."""
        if self.alive():
            return True
        if self.reaped or live_groups is None:
            return False
        return self.proc.pid in live_groups

    def signal(self, signum: int) -> None:
        """Signals the child's whole process group, its own workers too, whether the child
        still runs or has exited and left processes behind in it (the module docstring says
        why that is safe until the child is reaped)."""
        if self.reaped:
            return
        try:
            os.killpg(self.proc.pid, signum)  # start_new_session: the group id is its pid
        except ProcessLookupError:  # no process left in the group
            pass
        except PermissionError:  # none of the group would take it: the child itself, then
            try:
                os.kill(self.proc.pid, signum)
            except OSError:
                pass

    def reap(self) -> None:
        """Collects the exited child; from here on its pid may be another process's."""
        if self.reaped or self.proc.returncode is None:
            return
        self.reaped = True
        if _WAITID:
            try:
                os.waitpid(self.proc.pid, 0)
            except ChildProcessError:
                pass

    def drain(self, timeout: float = PIPE_DRAIN_S, quiet: float | None = None) -> None:
        """Waits until the relays have copied all the child's output (its pipes closed), at
        most ``timeout`` s. With ``quiet``, it also stops waiting once no line came for
        ``quiet`` s: a process the child left behind holds the pipes open, and its lines are
        relayed on while it runs."""
        start = time.monotonic()
        deadline = start + timeout
        while any(r.is_alive() for r in self.relays):
            now = time.monotonic()
            if now >= deadline:
                return
            if quiet is not None and now - max(start, self.last_output) >= quiet:
                return
            for r in self.relays:
                r.join(min(_POLL_S, max(0.0, deadline - now)))


def _live_groups() -> set[int] | None:
    """The ids of the process groups that hold a process that is not a zombie, read from
    /proc (Linux); None where there is no /proc."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    groups = set()
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # "PID (COMM) STATE PPID PGRP ...": COMM may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and fields[0] not in (b"Z", b"X"):
            groups.add(int(fields[2]))
    return groups


def _running(children: Sequence[Child]) -> list[Child]:
    """The children whose process group still has a process that runs."""
    exited = [c for c in children if not c.alive() and not c.reaped]
    live = _live_groups() if exited and _WAITID else None  # /proc is read only when needed
    return [c for c in children if c.group_running(live)]


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
    """The launcher's own line, which may quote a server's or a rank's words: its control
    characters shown as escapes (paramshard/terminal.py); ranks' and servers' lines, relayed
    as they came, are theirs."""
    emit(sys.stderr, f"paramshard launch: {printable(message)}\n".encode())


_RAISED = re.compile(rb"[A-Za-z_][\w.]*(Error|Exception): ")
"""A traceback's last line (``ValueError: ...``): what a rank that failed before it could
declare why (a bad config file, an import) said of it, for the launcher's summary."""


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
            child.last_output = time.monotonic()
            if lines is not None:
                lines.put((child, line))
            if log is not None:
                append_line(log, line)
            if _RAISED.match(line):
                child.last_error = line.decode("utf-8", "replace").strip()[:500]
            if dest is not None:
                emit(dest, prefix + line.rstrip(b"\r\n") + b"\n")
            child.last_output = time.monotonic()
        pipe.close()
        if log is not None:
            log.close()

    thread = threading.Thread(target=pump, name=f"relay {child.name}", daemon=True)
    thread.start()
    child.relays.append(thread)


def watch(child: Child, events: queue.SimpleQueue) -> None:
    """Puts ``("exit", child, code)`` once the child has exited and its output is relayed; at
    once if a process it left behind holds its pipes open (``Child.drain``'s ``quiet``). The
    child stays unreaped until ``stop()``."""

    def wait() -> None:
        code = child.wait_exit()
        child.drain(quiet=QUIET_S)
        events.put(("exit", child, code))

    threading.Thread(target=wait, name=f"watch {child.name}", daemon=True).start()


def stop(children: Sequence[Child], signum: int, grace: float, received: list[int]) -> None:
    """Sends ``signum`` to each child's process group, waits up to ``grace`` seconds for the
    groups to empty, then SIGKILLs whatever of them still runs, and reaps the children.
    ``signum`` is followed by SIGCONT (as systemd does): a child stopped by SIGSTOP or a
    debugger takes a signal only once it runs, and would otherwise wait out the grace.

    A group is stopped whether its child still runs or has exited and left processes in it.
    A signal arriving meanwhile (``received`` grows: a second Ctrl-C) ends the wait at once."""
    already = len(received)
    for child in children:
        child.signal(signum)
        if signum != signal.SIGKILL:
            child.signal(signal.SIGCONT)
    deadline = time.monotonic() + grace
    while _running(children) and time.monotonic() < deadline:
        if len(received) > already:
            break
        time.sleep(_POLL_S)
    for child in _running(children):
        if child.alive():
            say(f"{child.name} (pid {child.proc.pid}) still running: killing it")
        else:
            say(f"{child.name} (pid {child.proc.pid}) exited, but processes it started still"
                " run in its process group: killing them")  # fmt: skip
        child.signal(signal.SIGKILL)
    deadline = time.monotonic() + PIPE_DRAIN_S  # SIGKILL takes effect in milliseconds
    while (left := _running(children)) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    for child in left:
        say(f"{child.name} (pid {child.proc.pid}) or a process of its group did not die")
    for child in children:
        if child not in left:  # a group still running keeps its id reserved by its leader
            child.reap()
    for child in children:
        child.drain(timeout=max(0.0, deadline - time.monotonic()))


def exit_code(returncode: int) -> int:
    """A rank killed by signal S reports -S; a shell would say 128 + S."""
    return 128 - returncode if returncode < 0 else returncode
