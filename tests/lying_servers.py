"""Shard servers that lie to their callers (tests/test_lying_server.py).

``lying_server(**handlers)`` starts a real gRPC server on 127.0.0.1:0 whose Shard service answers
each named method with ``handler(request, context)`` (a reply message, or raise through
``context.abort``); every other method is UNIMPLEMENTED, as the generated servicer says. The
handlers play a server an attacker runs at an address a user was told to inspect, a compromised
host of a cluster, or a buggy peer: what they send is what the client and the tools must survive.

``job_status(...)`` builds the StatusReply of one job with one buffer holding the given
parameters, and ``pull_reply(...)`` the raw PullParams reply bytes (header, data), as a server
writes them; ``run_cli(args, ...)`` runs ``python -m paramshard`` in a child process with a
deadline and returns its exit code, stdout and stderr.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from paramshard.protos import shard_pb2 as pb
from paramshard.protos import shard_pb2_grpc

__all__ = [
    "LyingServer",
    "AbstractListener",
    "MemfdHandover",
    "lying_server",
    "job_status",
    "pull_reply",
    "run_cli",
]

Handler = Callable[[Any, grpc.ServicerContext], Any]


@dataclass
class LyingServer:
    address: str
    calls: list[str] = field(default_factory=list)  # methods called, in order


@contextmanager
def lying_server(**handlers: Handler) -> Iterator[LyingServer]:
    """A gRPC server on 127.0.0.1:0 answering ``handlers``' methods with their replies."""
    seen: list[str] = []

    def wrap(name: str, fn: Handler) -> Handler:
        def method(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            seen.append(name)
            return fn(request, context)

        return method

    servicer_cls = type(
        "LyingServicer",
        (shard_pb2_grpc.ShardServicer,),
        {name: wrap(name, fn) for name, fn in handlers.items()},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    shard_pb2_grpc.add_ShardServicer_to_server(servicer_cls(), server)
    with serving(server) as address:
        yield LyingServer(address, seen)


@contextmanager
def serving(server: grpc.Server) -> Iterator[str]:
    """``server`` started on a free port of 127.0.0.1: its address; stopped after."""
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait(5)


def job_status(
    job: str,
    params: Sequence[tuple[str, Sequence[int]]],
    *,
    numel: int | None = None,
    version: int = 1,
    dtype: str = "float32",
    **reply: Any,
) -> pb.StatusReply:
    """One server (slice 0 of 1) holding ``job`` with one buffer "b" of ``params`` (name,
    shape) laid out one after the other; ``numel``: the buffer's elements (default: theirs)."""
    entries, offset = [], 0
    for name, shape in params:
        n = 1
        for d in shape:
            n *= d
        entries.append(pb.ParamEntry(name=name, shape=list(shape), dtype=dtype, offset=offset))
        offset += n
    buffer = pb.BufferStatus(
        buffer="b",
        numel=offset if numel is None else numel,
        slice_start=0,
        slice_numel=offset if numel is None else numel,
        dtype=dtype,
        version=version,
        initialized=True,
        params=entries,
    )
    jobs = [pb.JobStatus(job=job, buffers=[buffer], server_index=0, num_servers=1)]
    return pb.StatusReply(server_index=0, num_servers=1, jobs=jobs, **reply)


def pull_reply(request: pb.PullParamsRequest, data: bytes, version: int = 1) -> pb.PullParamsReply:
    """A PullParams reply of ``data`` (whatever its size) for ``request``."""
    header = pb.PullParamsHeader(ref=request.ref, chunk=request.chunk, version=version)
    return pb.PullParamsReply(header=header, data=data)


class AbstractListener:
    """An abstract Unix socket ``@name`` of this process that records what connects to it and
    what it is sent (a local service a lying server might point a client at); ``answer(conn)``
    answers a connection (default: records its bytes and says no)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: list[bytes] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + name)
        self._sock.listen(4)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="abstract-listener", daemon=True)
        self._thread.start()

    def answer(self, conn: socket.socket) -> None:
        self.received.append(conn.recv(4096))
        conn.sendall(b"no")

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    self.answer(conn)
                except OSError:
                    self.received.append(b"")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


class MemfdHandover(AbstractListener):
    """A lying server's own segment handover: an abstract socket named as the servers name
    theirs, handing every ticket (of the servers' size) one memfd, sealed at its size, with
    ``PROOF_BYTES`` zero bytes at its start (what ``offer`` claims, ``ConfirmSegment`` takes):
    of ``nbytes``, or of the size the first offer was asked for."""

    def __init__(self, nbytes: int | None = None) -> None:
        from paramshard.protos import shm

        self.nbytes, self.fd = nbytes, -1
        self.ticket = b"t" * shm.TICKET_BYTES
        super().__init__(shm.handover_name())

    def offer(self, request: Any, context: grpc.ServicerContext) -> pb.OfferSegmentReply:
        from paramshard.protos import shm

        if self.fd < 0:
            self.nbytes = self.nbytes or request.nbytes
            self.fd = os.memfd_create("lying-segment", shm.MFD_ALLOW_SEALING)
            os.ftruncate(self.fd, self.nbytes)
            shm.seal(self.fd)
        return pb.OfferSegmentReply(
            segment=1, socket="@" + self.name, ticket=self.ticket, nbytes=self.nbytes
        )

    def answer(self, conn: socket.socket) -> None:
        self.received.append(conn.recv(64))
        socket.send_fds(conn, [b"ok"], [self.fd])

    def close(self) -> None:
        super().close()
        if self.fd >= 0:
            os.close(self.fd)


_LIMITED = (
    "import resource, runpy, sys; limit = int(sys.argv[1]);"
    " resource.setrlimit(resource.RLIMIT_AS, (limit, limit)) if limit else None;"
    " sys.argv = ['paramshard', *sys.argv[2:]]; runpy.run_module('paramshard', run_name='__main__')"
)


def run_cli(
    args: Sequence[str],
    timeout: float = 30.0,
    env: dict[str, str] | None = None,
    memory_limit: int = 0,
) -> subprocess.CompletedProcess[str]:
    """``python -m paramshard ARGS`` in a child process (killed past ``timeout``:
    TimeoutExpired), its address space at most ``memory_limit`` bytes (0: no limit), so that a
    tool allocating what a lying server claims fails with MemoryError instead of taking the
    machine's memory."""
    full_env = {**os.environ, "PARAMSHARD_SHM": "0", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", _LIMITED, str(memory_limit), *args],
        capture_output=True,
        text=True,
        errors="backslashreplace",
        timeout=timeout,
        env=full_env,
        check=False,
    )
