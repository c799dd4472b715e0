"""Shard servers for ``paramshard launch``: starting local ones (``paramshard serve --port 0``,
reading each one's address), starting one again at its address after it exited, and waiting
until running ones answer SERVING."""

from __future__ import annotations

import queue
import re
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from paramshard.commands import CommandError, paramshard_argv
from paramshard.processes import Child, relay, say, spawn, stop

__all__ = [
    "CONNECT_GRACE_S", "SERVER_STOP_S", "START_TIMEOUT_S", "restart_local_server",
    "start_local_servers", "wait_serving",
]  # fmt: skip

LISTENING = re.compile(rb"listening on (\S+)")
SERVER_STOP_S = 15.0  # a server gets this long after SIGTERM (its own --grace is 5 s)
START_TIMEOUT_S = 60.0  # launch's --start-timeout unless given
CONNECT_GRACE_S = 3.0
"""How long ``wait_serving`` tries a server it cannot reach (refused, DNS, TLS, token) unless
told otherwise: enough for a server just starting to open its port, short enough that a wrong
address or credential is named at once instead of after --start-timeout."""
_PROGRESS_S = 15.0  # a long wait for a server says every this often what it waits for


def start_local_servers(
    n: int, device: str, env: dict[str, str], timeout: float, serve_args: Sequence[str] = ()
) -> tuple:
    """Starts n ``paramshard serve --port 0`` on 127.0.0.1; returns (children, addresses).

    ``--device cuda`` puts server i on cuda:i (one per GPU); cpu or cuda:K is used as given.
    ``serve_args``: more ``paramshard serve`` arguments for each (launch's --snapshot-dir).
    ``env`` gets the MALLOC_* settings of docs/design.md §7.5 where it has none of its own (serve
    would re-execute itself to get them)."""
    lines: queue.SimpleQueue = queue.SimpleQueue()
    children: list[Child] = []
    try:
        for i in range(n):
            children.append(_spawn_server(i, 0, device, env, serve_args, lines))
        addresses = _read_addresses(children, lines, timeout)
    except BaseException:
        stop(children, signal.SIGTERM, SERVER_STOP_S, [])
        raise
    return children, addresses


def restart_local_server(
    index: int,
    address: str,
    device: str,
    env: dict[str, str],
    timeout: float,
    serve_args: Sequence[str] = (),
) -> Child:
    """Starts server ``index`` of ``start_local_servers`` again, empty, at ``address`` (its
    port) after it exited; returns its process once it prints that address. CommandError if it
    exits first (its port taken meanwhile) or stays silent for ``timeout`` s."""
    lines: queue.SimpleQueue = queue.SimpleQueue()
    port = int(address.rsplit(":", 1)[1])
    child = _spawn_server(index, port, device, env, serve_args, lines)
    try:
        (got,) = _read_addresses([child], lines, timeout)
    except BaseException:
        stop([child], signal.SIGTERM, SERVER_STOP_S, [])
        raise
    if got != address:  # cannot happen with an explicit --port; a guard, not a wait
        stop([child], signal.SIGTERM, SERVER_STOP_S, [])
        raise CommandError(f"{child.name} came back at {got}, not at {address}")
    return child


def _spawn_server(
    index: int,
    port: int,
    device: str,
    env: dict[str, str],
    serve_args: Sequence[str],
    lines: queue.SimpleQueue,
) -> Child:
    from paramshard.server.app import MALLOC_ENV

    dev = f"cuda:{index}" if device == "cuda" else device
    cmd = paramshard_argv("serve", "--port", str(port), "--device", dev, *serve_args)
    child = spawn(f"server {index}", cmd, {**MALLOC_ENV, **env})
    relay(child, child.proc.stdout, sys.stderr, lines)
    relay(child, child.proc.stderr, sys.stderr, None)
    return child


def _read_addresses(children: list[Child], lines: queue.SimpleQueue, timeout: float) -> list[str]:
    """Each child's address from its "listening on ADDRESS" line, within ``timeout`` s."""
    n = len(children)
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
    return [addresses[i] for i in range(n)]


def wait_serving(
    addresses: Sequence[str],
    token: str | None,
    timeout: float,
    *,
    unreachable_s: float = CONNECT_GRACE_S,
) -> None:
    """Waits until every server's grpc.health.v1 check says SERVING, at most ``timeout`` s,
    and checks that it takes the ranks' credentials (a ``Status`` call with the token). A
    server that cannot be reached (connection refused, a name that does not resolve, a TLS
    handshake that fails) fails once that lasted ``unreachable_s`` (a server being started
    beside the caller needs its whole start), naming its address and the cause
    (client/unreachable.py); one that refuses the token fails at once; one that answers but is
    not serving yet is awaited up to ``timeout``."""
    from paramshard.commands import cluster_spec

    spec = cluster_spec(",".join(addresses))  # TLS files from PARAMSHARD_TLS_* like the ranks
    if token:
        spec.token = token
    try:
        for i in range(len(spec.addresses)):
            _wait_one(spec, i, timeout, unreachable_s)
    finally:
        spec.close()


def _wait_one(spec: Any, index: int, timeout: float, unreachable_s: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from paramshard.client import unreachable
    from paramshard.protos import shard_pb2 as pb
    from paramshard.protos.service import method_path
    from paramshard.protos.words import details_of

    address = spec.addresses[index]
    began = time.monotonic()
    deadline = began + timeout
    stub = health_pb2_grpc.HealthStub(spec.channel(index))
    last = "no answer"
    told = began
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommandError(
                f"server {address} is not serving after {timeout:g} s (--start-timeout): {last}"
            )
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(), timeout=min(left, 5.0), metadata=spec.metadata()
            )
        except grpc.RpcError as exc:
            code, details = exc.code(), details_of(exc)
            last = f"{code.name}: {details}"
            why = unreachable.cause(code, details)
            now = time.monotonic()
            if why is not None and now - began >= min(unreachable_s, timeout):
                raise CommandError(
                    f"server {address} is unreachable: {why} (tried for {now - began:.1f} s;"
                    f" grpc: {last})"
                ) from None
            if now - told >= _PROGRESS_S:  # a long wait is not a silent one
                say(f"still waiting for server {address} ({now - began:.0f} s): {why or last}")
                told = now
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
            continue
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            break
        last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    # the health service is open to everyone: a call of the Shard service checks the token
    status = spec.channel(index).unary_unary(
        method_path("Status"),
        request_serializer=pb.StatusRequest.SerializeToString,
        response_deserializer=pb.StatusReply.FromString,
    )
    try:
        status(pb.StatusRequest(), timeout=5.0, metadata=spec.metadata())
    except grpc.RpcError as exc:
        code, details = exc.code(), details_of(exc)
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            raise CommandError(
                f"server {address} refuses the ranks' token: {code.name}:"
                f" {unreachable.explain(address, code, details)}"
            ) from None
