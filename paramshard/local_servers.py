"""Shard servers for ``paramshard launch``: starting local ones (``paramshard serve --port 0``,
reading each one's address) and waiting until running ones answer SERVING."""

from __future__ import annotations

import queue
import re
import signal
import sys
import time
from collections.abc import Sequence

from paramshard.commands import CommandError, paramshard_argv
from paramshard.processes import Child, relay, spawn, stop

__all__ = ["SERVER_STOP_S", "start_local_servers", "wait_serving"]

LISTENING = re.compile(rb"listening on (\S+)")
SERVER_STOP_S = 15.0  # a server gets this long after SIGTERM (its own --grace is 5 s)


def start_local_servers(n: int, device: str, env: dict[str, str], timeout: float) -> tuple:
    """Starts n ``paramshard serve --port 0`` on 127.0.0.1; returns (children, addresses).

    ``--device cuda`` puts server i on cuda:i (one per GPU); cpu or cuda:K is used as given."""
    lines: queue.SimpleQueue = queue.SimpleQueue()
    children: list[Child] = []
    try:
        for i in range(n):
            dev = f"cuda:{i}" if device == "cuda" else device
            cmd = paramshard_argv("serve", "--port", "0", "--device", dev)
            children.append(spawn(f"server {i}", cmd, env))
            relay(children[-1], children[-1].proc.stdout, sys.stderr, lines)
            relay(children[-1], children[-1].proc.stderr, sys.stderr, None)
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

    from paramshard.commands import cluster_spec

    spec = cluster_spec(",".join(addresses))  # TLS files from PARAMSHARD_TLS_* like the ranks
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
