"""``paramshard launch``: start shard servers and trainer ranks on this host, torchrun style.

    paramshard launch --nproc 2 train.py --lr 3e-4            # 2 local servers + 2 ranks
    paramshard launch --nproc 4 --servers h1:50051,h2:50051 train.py   # servers already running
    paramshard launch --nnodes 2 --node-rank 1 --nproc 4 --servers ... --run-id exp7 train.py

Without ``--servers`` it starts one ``paramshard serve --port 0`` per rank on 127.0.0.1 and reads
each one's "listening on ADDRESS" line (bounded by ``--start-timeout``). With ``--servers`` it
waits, equally bounded, until every server's health check says SERVING. Then it starts
``--nproc`` copies of ``python SCRIPT ARGS`` with the environment torchrun would give them plus
the cluster: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, PARAMSHARD_SERVERS,
PARAMSHARD_RUN (one id shared by all ranks, so two runs on the same servers never share
collective slots), PARAMSHARD_TOKEN (from ``--token-file``) and the MALLOC_* settings of DESIGN
section 7, which glibc reads only when a process starts.

Every line a rank prints comes out as ``[rank R] LINE`` (stdout to stdout, stderr to stderr);
server lines go to stderr as ``[server I] LINE``. Ctrl-C and SIGTERM are forwarded to the ranks;
a second one kills them. When a rank exits non-zero the others get SIGTERM, ``--grace`` seconds,
then SIGKILL, and the launcher exits with that rank's code. Local servers are stopped last.
With ``--max-restarts K`` a failed ZeRO-1/2 or FSDP rank is started again instead, alone, and
resumes at the servers' step (paramshard/restarts.py). ``--config FILE`` hands every rank the same
ShardingConfiguration file and ``--log-dir DIR`` keeps each rank's output in files, in torchrun's
layout (paramshard/launch_files.py).
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from client.run_id import run_id_from_env
from paramshard.commands import (
    EXIT_USAGE,
    CommandError,
    arg,
    command,
    positive,
    positive_int,
)
from paramshard.launch_files import RankLogs, append_line, config_env

__all__ = ["launch", "rank_env", "read_token"]

LISTENING = re.compile(rb"listening on (\S+)")
SERVER_STOP_S = 15.0  # a server gets this long after SIGTERM (its own --grace is 5 s)
PIPE_DRAIN_S = 5.0  # output a process left in its pipes is relayed for at most this long

_print_lock = threading.Lock()


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not an integer >= 0")
    return value


# ------------------------------------------------------------------------------ the processes
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


def _parent_death_signal() -> Any:
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


def _spawn(name: str, cmd: list[str], env: dict[str, str]) -> Child:
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # Ctrl-C reaches only the launcher, which forwards it
        preexec_fn=_parent_death_signal(),  # noqa: PLW1509 - one prctl call, nothing to lock
    )
    return Child(name, proc)


def _emit(stream: IO[str], data: bytes) -> None:
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
    _emit(sys.stderr, f"paramshard launch: {message}\n".encode())


def _relay(
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
                _emit(dest, prefix + line.rstrip(b"\r\n") + b"\n")
        pipe.close()
        if log is not None:
            log.close()

    thread = threading.Thread(target=pump, name=f"relay {child.name}", daemon=True)
    thread.start()
    child.relays.append(thread)


def _watch(child: Child, events: queue.SimpleQueue) -> None:
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


# --------------------------------------------------------------------------------- the servers
def start_local_servers(n: int, device: str, env: dict[str, str], timeout: float) -> tuple:
    """Starts n ``paramshard serve --port 0`` on 127.0.0.1; returns (children, addresses).

    ``--device cuda`` puts server i on cuda:i (one per GPU); cpu or cuda:K is used as given."""
    lines: queue.SimpleQueue = queue.SimpleQueue()
    children: list[Child] = []
    try:
        for i in range(n):
            dev = f"cuda:{i}" if device == "cuda" else device
            cmd = [sys.executable, "-m", "paramshard", "serve", "--port", "0", "--device", dev]
            children.append(_spawn(f"server {i}", cmd, env))
            _relay(children[-1], children[-1].proc.stdout, sys.stderr, lines)
            _relay(children[-1], children[-1].proc.stderr, sys.stderr, None)
        addresses: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(addresses) < n:
            try:
                child, line = lines.get(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                for i, c in enumerate(children):
                    if i not in addresses and not c.alive():
                        c.drain()
                        raise CommandError(
                            f"{c.name} exited while starting (exit code {c.proc.returncode});"
                            " its output is above"
                        ) from None
                if time.monotonic() >= deadline:
                    late = [c.name for i, c in enumerate(children) if i not in addresses]
                    raise CommandError(
                        f"{', '.join(late)} did not print its address within {timeout:g} s"
                        " (--start-timeout)"
                    ) from None
                continue
            match = LISTENING.search(line)
            index = children.index(child)
            if match and index not in addresses:
                addresses[index] = match.group(1).decode()
    except BaseException:
        stop(children, signal.SIGTERM, SERVER_STOP_S, [])
        raise
    return children, [addresses[i] for i in range(n)]


def wait_serving(addresses: Sequence[str], token: str | None, timeout: float) -> None:
    """Waits until every server's grpc.health.v1 check says SERVING, at most ``timeout`` s."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from paramshard.commands import _cluster_spec

    spec = _cluster_spec(",".join(addresses))  # TLS files from PARAMSHARD_TLS_* like the ranks
    if token:
        spec.token = token
    deadline = time.monotonic() + timeout
    try:
        for i, address in enumerate(spec.addresses):
            stub = health_pb2_grpc.HealthStub(spec.channel(i))
            last = "no answer"
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommandError(
                        f"server {address} is not serving after {timeout:g} s (--start-timeout):"
                        f" {last}"
                    )
                try:
                    reply = stub.Check(
                        health_pb2.HealthCheckRequest(),
                        timeout=min(left, 5.0),
                        wait_for_ready=True,  # a server still starting (or its DNS name) is awaited
                        metadata=spec.metadata(),
                    )
                except grpc.RpcError as exc:
                    code = exc.code()
                    if code in (
                        grpc.StatusCode.UNAUTHENTICATED,
                        grpc.StatusCode.PERMISSION_DENIED,
                    ):
                        raise CommandError(
                            f"server {address}: {code.name}: {exc.details()}"
                        ) from None
                    last = f"{code.name}: {exc.details()}"
                    continue
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    finally:
        spec.close()


# ----------------------------------------------------------------------------------- the ranks
def rank_env(
    base: dict[str, str],
    *,
    rank: int,
    local_rank: int,
    nproc: int,
    node_rank: int,
    world_size: int,
    servers: Sequence[str],
    run_id: str,
    token: str | None = None,
) -> dict[str, str]:
    """The environment of one rank: ``base`` plus what torchrun sets plus the cluster.

    MALLOC_* values already in ``base`` are kept (the user's choice); the rest are overridden."""
    from server.app import MALLOC_ENV

    env = {**MALLOC_ENV, **base}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK=str(node_rank),
        PARAMSHARD_SERVERS=",".join(servers),
        PARAMSHARD_RUN=run_id,
        PYTHONUNBUFFERED="1",  # lines reach us as they are printed, not when a buffer fills
    )
    if token:
        env["PARAMSHARD_TOKEN"] = token
    return env


def exit_code(returncode: int) -> int:
    """A rank killed by signal S reports -S; a shell would say 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def read_token(path: str | None) -> str | None:
    """The token the ranks send, from ``--token-file``: either the bare token, or a server token
    file (``ROLE TOKEN`` per line, as ``paramshard serve --token-file`` reads) whose ``train``
    token is taken (``admin`` if it has none), so one secret can serve both."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln.split() for ln in f.read().splitlines()]
    except OSError as exc:
        raise CommandError(
            f"--token-file: cannot read {path}: {exc.strerror}", EXIT_USAGE
        ) from None
    lines = [ln for ln in lines if ln and not ln[0].startswith("#")]
    if len(lines) == 1 and len(lines[0]) == 1:
        return lines[0][0]
    by_role = {ln[0]: ln[1] for ln in lines if len(ln) == 2}
    for role in ("train", "admin"):
        if role in by_role:
            return by_role[role]
    raise CommandError(
        f"--token-file {path}: expected one token, or 'ROLE TOKEN' lines with a train or admin"
        " token",
        EXIT_USAGE,
    )


@command(
    arg("--nproc", type=positive_int, required=True, help="ranks to start on this host"),
    arg(
        "--servers",
        metavar="HOST:PORT,...",
        help="running shard servers to use (default: start --nproc local ones on 127.0.0.1)",
    ),
    arg(
        "--device",
        default="cpu",
        help="device of the local servers: cpu, cuda (server i on cuda:i) or cuda:K"
        " (default: %(default)s)",
    ),
    arg("--nnodes", type=positive_int, default=1, help="hosts running ranks (default: 1)"),
    arg(
        "--node-rank",
        type=non_negative_int,
        default=0,
        help="this host's index: its ranks are node-rank * nproc + 0..nproc-1 (default: 0)",
    ),
    arg(
        "--run-id",
        default=None,
        help="PARAMSHARD_RUN shared by all ranks; needed with --nnodes > 1"
        " (default: $PARAMSHARD_RUN, else torchrun's $TORCHELASTIC_RUN_ID, else a random id)",
    ),
    arg(
        "--config",
        metavar="FILE",
        default=None,
        help="a ShardingConfiguration file (.json, .toml, .yaml) every rank's"
        " ShardingConfiguration.from_env() starts from (PARAMSHARD_CONFIG); its keyword"
        " arguments override the file",
    ),
    arg(
        "--log-dir",
        metavar="DIR",
        default=None,
        help="also write each rank's output to DIR/RUN_ID/attempt_N/RANK/stdout.log and"
        " stderr.log (torchrun's layout; N counts that rank's restarts)",
    ),
    arg(
        "--redirects",
        action="store_true",
        help="with --log-dir: the ranks' output goes to the files only, not to this console"
        " (torchrun's --redirects 3 without --tee)",
    ),
    arg(
        "--token-file",
        default=None,
        help="the bearer token for the ranks (PARAMSHARD_TOKEN): a file holding the token, or"
        " a server token file ('ROLE TOKEN' lines) whose train token is used",
    ),
    arg(
        "--start-timeout",
        type=positive,
        default=60.0,
        help="seconds the servers get to start or to answer SERVING (default: %(default)g)",
    ),
    arg(
        "--grace",
        type=positive,
        default=10.0,
        help="seconds the ranks get after SIGTERM/SIGINT, then SIGKILL (default: %(default)g)",
    ),
    arg(
        "--max-restarts",
        type=non_negative_int,
        default=0,
        help="restart a failed rank, alone, up to this many times in all: for ZeRO-1/2 and"
        " FSDP, whose state is on the servers (a DDP or 3D rank's failure still stops the job;"
        " default: %(default)s)",
    ),
    arg("-m", "--module", action="store_true", help="run SCRIPT as a module (python -m SCRIPT)"),
    arg("script", metavar="SCRIPT", help="the training script (or module with -m)"),
    arg("script_args", metavar="ARGS", nargs=argparse.REMAINDER, help="its arguments"),
)
def launch(args: argparse.Namespace) -> int:
    """Start shard servers and --nproc trainer ranks (torchrun style); stop them all at the end.

    Each rank runs 'python SCRIPT ARGS' with RANK, WORLD_SIZE, LOCAL_RANK, PARAMSHARD_SERVERS,
    PARAMSHARD_RUN and the MALLOC_* settings set; its lines are printed as '[rank R] ...'.
    Without --servers, --nproc local servers are started on 127.0.0.1 and stopped at the end.
    Ctrl-C/SIGTERM are forwarded to the ranks. If a rank fails, the others are stopped (SIGTERM,
    --grace seconds, SIGKILL) and the launcher exits with the failed rank's code; 0 when all
    ranks succeed. With --max-restarts K, a failed ZeRO-1/2 or FSDP rank is started again
    instead (K times in all) and resumes at the servers' step.
    """
    if args.node_rank >= args.nnodes:
        raise CommandError(
            f"--node-rank {args.node_rank} must be < --nnodes {args.nnodes}", EXIT_USAGE
        )
    if args.nnodes > 1 and not args.servers:
        raise CommandError(
            "--nnodes > 1 needs --servers: every host must use the same ones", EXIT_USAGE
        )
    run_id = args.run_id or run_id_from_env() or ""
    if args.nnodes > 1 and not run_id:
        raise CommandError("--nnodes > 1 needs --run-id (the same on every host)", EXIT_USAGE)
    run_id = run_id or f"run-{secrets.token_hex(6)}"
    if not args.module and not os.path.isfile(args.script):
        raise CommandError(f"no such script: {args.script}", EXIT_USAGE)
    token = read_token(args.token_file)
    world_size = args.nnodes * args.nproc
    ranks_config = config_env(args.config)
    logs = RankLogs.create(args.log_dir, run_id)
    if args.redirects and logs is None:
        raise CommandError("--redirects needs --log-dir (where the output goes)", EXIT_USAGE)
    console_out, console_err = (None, None) if args.redirects else (sys.stdout, sys.stderr)

    from paramshard.restarts import RankRestarts, supervise
    from server.app import MALLOC_ENV

    base = {**MALLOC_ENV, **os.environ, "PYTHONUNBUFFERED": "1", **ranks_config}
    restarts = RankRestarts.create(args.max_restarts)
    received: list[int] = []
    events: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe inside a signal handler
    supervising = False

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        if not supervising:  # still starting: unwind, and the finally clause stops everything
            raise _Interrupted(signum)
        events.put(("signal", None, signum))  # supervise forwards it; stop() sees `received`

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    servers: list[Child] = []
    ranks: list[Child] = []
    try:
        if args.servers:
            addresses = [a.strip() for a in args.servers.split(",") if a.strip()]
            wait_serving(addresses, token, args.start_timeout)
        else:
            servers, addresses = start_local_servers(
                args.nproc, args.device, base, args.start_timeout
            )
            say(f"started {len(servers)} shard servers: {', '.join(addresses)}")

        supervising = True
        python = [sys.executable, "-m"] if args.module else [sys.executable]

        def start_rank(rank: int) -> Child:
            env = rank_env(
                base,
                rank=rank,
                local_rank=rank - args.node_rank * args.nproc,
                nproc=args.nproc,
                node_rank=args.node_rank,
                world_size=world_size,
                servers=addresses,
                run_id=run_id,
                token=token,
            )
            env.update(restarts.env(rank))
            out, err = logs.open(rank, restarts.attempt(rank)) if logs else (None, None)
            child = _spawn(f"rank {rank}", [*python, args.script, *args.script_args], env)
            child.rank = rank
            _relay(child, child.proc.stdout, console_out, None, out)
            _relay(child, child.proc.stderr, console_err, None, err)
            _watch(child, events)
            return child

        if logs:
            also = "only" if args.redirects else "also"
            say(f"rank output {also} goes to {logs.root}/attempt_N/RANK/stdout.log, stderr.log")
        for local_rank in range(args.nproc):
            ranks.append(start_rank(args.node_rank * args.nproc + local_rank))
        for server in servers:
            _watch(server, events)
        return supervise(ranks, servers, events, received, args.grace, restarts, start_rank)
    except _Interrupted as exc:
        say(f"{signal.Signals(exc.signum).name} while starting: stopping")
        return 128 + exc.signum
    finally:
        supervising = True  # from here on a signal only hurries the stops below
        stop(ranks, signal.SIGTERM, args.grace, received)
        stop(servers, signal.SIGTERM, SERVER_STOP_S, received)
        restarts.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class _Interrupted(Exception):
    """SIGINT or SIGTERM before the ranks run (the launcher exits with 128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
