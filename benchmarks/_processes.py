"""Child processes for the benchmarks: start them, talk to them line by line, stop them by PID.

Shared by ``benchmarks.collectives``, ``benchmarks.strategies``, ``benchmarks.hybrid`` (and
``benchmarks.recovery`` for ``free_port``). Shard servers are started by ``paramshard launch``'s
own code (``serve_processes``). Conventions:

- A child runs one hidden mode of a benchmark module (``python -m benchmarks.X _mode ...``),
  is started with ``subprocess`` (so environment variables such as ``server.MALLOC_ENV`` are
  set before its interpreter starts) and answers on stdout with ``TAG payload`` lines
  (``emit``); other stdout lines are passed on to our stderr. The parent writes to its stdin.
- Every child calls ``child_guard`` first: it dies with its parent (``PR_SET_PDEATHSIG``, and
  a thread that watches ``getppid``) and exits on its own when its lifetime runs out. It closes
  its clients and servers on every way out (a closed stdin raises ``SystemExit``), and
  ``run_child`` ends it at once after that.
- The parent stops children by PID only (``stop_all``): close stdin (their cue to exit), wait,
  then SIGTERM, then SIGKILL; ``install_cleanup`` does it at exit and on SIGINT/TERM/HUP.
- CPU and memory accounting (``Load``, ``wait_quiet``, a process's CPU seconds) is in
  ``benchmarks/_cpu.py``.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MALLOC_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")


def logger(name: str) -> Callable[[str], None]:
    """A ``log(msg)`` that prints ``[name HH:MM:SS] msg`` to stderr."""

    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


log = logger("benchmarks")


# =============================================================================== parent side
class ChildError(RuntimeError):
    pass


class ChildTimeout(ChildError):
    pass


class Child:
    """A child process whose stdout we read line by line (other lines go to our stderr).

    ``terminate_on_stop``: the child does not exit when its stdin closes (a server process),
    so ``stop_all`` sends it SIGTERM at once."""

    registry: list[Child] = []

    def __init__(
        self, name: str, cmd: list[str], env: dict[str, str], terminate_on_stop: bool = False
    ) -> None:
        self.name = name
        self.terminate_on_stop = terminate_on_stop
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        Child.registry.append(self)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    @classmethod
    def module(
        cls,
        name: str,
        module: str,
        argv: list[str],
        env: dict[str, str],
        lifetime: float,
        prefix: Sequence[str] = (),
    ) -> Child:
        """``python -m module *argv --lifetime L``, after ``prefix`` (``ip netns exec NS``)."""
        cmd = [*prefix, sys.executable, "-m", module, *argv, "--lifetime", str(lifetime)]
        return cls(name, cmd, env)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(
        self, tag: str, timeout: float, watch: Iterable[Child] = (), anywhere: bool = False
    ) -> str:
        """The payload of the next ``TAG payload`` line (``anywhere``: the text after ``tag``
        in the next line containing it), within ``timeout`` seconds. Fails early when a
        ``watch``ed child exits with an error."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildTimeout(f"{self.name}: no {tag.strip()} within {timeout:.0f} s")
            for w in watch:
                if w is not self and w.proc.poll() not in (None, 0):
                    raise ChildError(f"{w.name} exited (rc={w.proc.returncode})")
            try:
                line = self.lines.get(timeout=min(1.0, left))
            except queue.Empty:
                continue
            if line is None:
                rc = self.proc.wait(timeout=10)
                raise ChildError(f"{self.name} exited (rc={rc}) before sending {tag.strip()}")
            if anywhere and tag in line:
                return line.split(tag, 1)[1].strip()
            if not anywhere and line.startswith(tag + " "):
                return line[len(tag) + 1 :]
            print(f"  [{self.name}] {line}", file=sys.stderr, flush=True)

    def send(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            raise ChildError(f"{self.name}: cannot write to it ({exc})") from None

    def stop(self, timeout: float = 15.0) -> None:
        stop_all([self], timeout)


def expect_all(
    kids: list[Child], tag: str, timeout: float, watch: Iterable[Child] = ()
) -> list[str]:
    """Every kid's next ``tag`` payload, in order; fails as soon as a kid or a watched child
    exits (a kid's own exit surfaces through its ``expect`` once its output is drained)."""
    deadline = time.monotonic() + timeout
    watch = list(watch)
    got: dict[int, str] = {}
    while len(got) < len(kids):
        for i, k in enumerate(kids):
            if i not in got:
                try:
                    got[i] = k.expect(tag, 0.1)
                except ChildTimeout:
                    pass
        for w in watch:
            if w not in kids and w.proc.poll() is not None:
                raise ChildError(
                    f"{w.name} exited (rc={w.proc.returncode}) while waiting for {tag}"
                )
        if time.monotonic() > deadline and len(got) < len(kids):
            missing = [k.name for i, k in enumerate(kids) if i not in got]
            raise ChildError(f"no {tag} from {missing} within {timeout:.0f} s")
    return [got[i] for i in range(len(kids))]


def stop_all(children: Iterable[Child] | None = None, timeout: float = 15.0) -> None:
    """Stops the given children (default: every one still registered), all at once: close
    their stdin (their cue to exit; ``terminate_on_stop`` ones also get SIGTERM), wait up to
    ``timeout`` s, then SIGTERM, then SIGKILL, each by its PID; reaps them."""
    kids = list(Child.registry if children is None else children)
    for c in kids:
        try:
            if c.proc.poll() is None:
                if c.proc.stdin is not None:
                    c.proc.stdin.close()
                if getattr(c, "terminate_on_stop", True):  # serve_processes' have no stdin
                    c.proc.terminate()
        except OSError:
            pass
    for grace, action in ((timeout, "terminate"), (5.0, "kill"), (5.0, None)):
        deadline = time.monotonic() + grace
        for c in kids:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        alive = [c for c in kids if c.proc.poll() is None]
        if not alive:
            break
        if action is None:
            log(f"could not stop {[c.name for c in alive]}")
            break
        for c in alive:
            getattr(c.proc, action)()
    for c in kids:
        if c in Child.registry and c.proc.poll() is not None:
            Child.registry.remove(c)


def install_cleanup(grace: float = 3.0) -> None:
    """Stop every child at exit and on SIGINT / SIGTERM / SIGHUP (then exit 128 + signal)."""

    def on_signal(signum: int, _frame: Any) -> None:
        stop_all(timeout=grace)
        os._exit(128 + signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    atexit.register(stop_all, None, grace)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(tuned: bool) -> dict[str, str]:
    """Our environment for a child: the allocator settings of ``server.MALLOC_ENV`` when
    ``tuned``, else none of them (even if we have them); the repository on PYTHONPATH; gRPC
    quiet (a rank whose in-process server stops first makes the others' channels log)."""
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_KEYS}
    if tuned:
        from paramshard.server import MALLOC_ENV

        env.update(MALLOC_ENV)
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    env.setdefault("GRPC_VERBOSITY", "ERROR")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def serve_processes(
    n: int, timeout: float, serve_args: Sequence[str] = ()
) -> tuple[list[Any], list[str]]:
    """n ``paramshard serve --port 0 *serve_args`` started the way ``paramshard launch`` starts
    local servers (paramshard/local_servers.py: they die with us), with ``server.MALLOC_ENV``;
    returns them and their addresses. ``stop_all`` stops them (SIGTERM at once)."""
    from paramshard.local_servers import start_local_servers

    return start_local_servers(n, "cpu", child_env(tuned=True), timeout, serve_args)


def malloc_env_state() -> dict[str, str]:
    """The allocator settings this process was started with."""
    return {k: os.environ[k] for k in MALLOC_KEYS if k in os.environ}


# ================================================================================ child side
def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the parent exits (and exit now if it already did)."""
    ppid = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != ppid or ppid == 1:
        os._exit(3)


def child_guard(lifetime: float) -> None:
    """Dies with the parent; exits on its own when ``lifetime`` s run out (no orphans). SIGTERM
    (``stop_all``'s second cue) unwinds like a closed stdin: what the child opened is closed."""
    _die_with_parent()
    parent = os.getppid()

    def on_sigterm(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)

    def watch() -> None:
        end = time.monotonic() + lifetime
        while time.monotonic() < end:
            if os.getppid() != parent:
                os._exit(5)
            time.sleep(0.5)
        print(f"child {os.getpid()}: lifetime {lifetime:.0f} s exceeded", file=sys.stderr)
        os._exit(4)

    threading.Thread(target=watch, daemon=True).start()


def run_child(main: Callable[[], object]) -> NoReturn:
    """Runs a child's ``main`` (which closes what it opens, on every way out), then ends the
    process at once, with 0, the code of a ``SystemExit``, or 1 after printing what it raised.

    At once: a rank that imported torch and transformers holds about 350,000 objects, and the
    interpreter's own teardown of them (its final collections, then every module's objects)
    took 15-25 s per process with four ranks on two busy cores (the 3D Llama cell's ranks, in
    ``gc_collect_main``). Nothing left by then needs it: output is flushed here, and the
    operating system takes the memory and descriptors back."""
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:  # noqa: BLE001 - reported, then the exit code says it
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def emit(tag: str, payload: Any) -> None:
    """Writes ``TAG payload`` (a string as is, anything else as JSON) to stdout."""
    text = payload if isinstance(payload, str) else json.dumps(payload)
    sys.stdout.write(f"{tag} {text}\n")
    sys.stdout.flush()


def read_line(expect: str, timeout: float) -> str:
    """The payload of the next stdin line starting with ``expect`` (EOF: the parent is gone)."""
    box: queue.Queue[str | None] = queue.Queue()

    def reader() -> None:
        box.put(sys.stdin.readline())

    threading.Thread(target=reader, daemon=True).start()
    try:
        line = box.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"no {expect} from the parent within {timeout:.0f} s") from None
    if not line:  # the parent closed our stdin: stop now, closing what we opened on the way
        raise SystemExit(5)
    if not line.startswith(expect):
        raise RuntimeError(f"expected {expect}, got {line.strip()!r}")
    return line[len(expect) :].strip()


def wait_parent_eof() -> None:
    """Blocks until the parent closes our stdin (or writes EXIT)."""
    for line in sys.stdin:
        if line.strip() == "EXIT":
            return
