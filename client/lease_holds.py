"""A rank's open ``HoldLease`` stream to one server: the half of its lease that needs no Python.

While the stream is open the server holds the rank's lease, however long the rank's Python code
is stopped, paused or busy: the connection lives in the two hosts' kernels
(server/collectives/lease_holds.py). When the process dies its kernel closes the connection and
the server takes the rank for lost within seconds. The stream also brings the run's notices as
the server raises them, read here by a thread of its own that blocks in gRPC (without the GIL).
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from paramshard.protos import closing
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.service import method_path
from paramshard.protos.words import details_of

__all__ = ["CONFLICT", "HoldStream", "LeaseConflict", "REFUSALS", "holder_id", "next_client"]

_METHOD = method_path("HoldLease")
REFUSALS = frozenset(
    {
        grpc.StatusCode.UNIMPLEMENTED,  # an older server
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # at its bound of streams (--max-sessions)
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)
"""How a server says no to a stream: asked again only after a while (the lease lives on
renewals meanwhile), unlike a stream that broke, which is opened again at once."""
CONFLICT = grpc.StatusCode.ALREADY_EXISTS
"""How a server says that another process holds this rank through an open stream
(server/collectives/lease_requests.py, ``check_holder``): two jobs share the run id."""


class LeaseConflict(RuntimeError):
    """Another process holds this rank of this run on a server (two jobs share the run id, or
    the rank was started twice): the client cannot be made; says which process, and where."""


_holder_lock = threading.Lock()
_holder: tuple[int, str] | None = None  # (pid, id)


def holder_id() -> str:
    """This process as the servers know it (``LeaseRequest.holder``): its host, its pid, and a
    random part, since pids are reused; a forked child gets its own."""
    global _holder
    with _holder_lock:
        pid = os.getpid()
        if _holder is None or _holder[0] != pid:
            _holder = (pid, f"{socket.gethostname()[:64]} pid {pid} {secrets.token_hex(4)}")
        return _holder[1]


_clients = itertools.count(1)


def next_client() -> int:
    """A number for one more client of this process (``LeaseRequest.client``): a closed
    client's release, late on a loaded machine, then drops nothing of the lease that the
    process's next client holds for the same rank."""
    return next(_clients)


class HoldStream:
    """One open stream; ``on_reply(reply)`` runs on its thread for every reply."""

    def __init__(
        self,
        channel: grpc.Channel,
        request: pb.LeaseRequest,
        metadata: Any,
        on_reply: Callable[[pb.LeaseReply], None],
        name: str,
    ) -> None:
        stub = channel.unary_stream(
            _METHOD,
            request_serializer=pb.LeaseRequest.SerializeToString,
            response_deserializer=pb.LeaseReply.FromString,
        )
        self._call = stub(request, metadata=metadata)  # no deadline: open while the rank lives
        self.ended: tuple[grpc.StatusCode, str] | None = None
        self.ended_at = 0.0
        self.answered = threading.Event()  # its first reply came, or it ended
        self._thread = threading.Thread(
            target=self._read, args=(self._call, on_reply), name=name, daemon=True
        )
        self._thread.start()

    @property
    def open(self) -> bool:
        return self.ended is None

    def _read(self, call: Any, on_reply: Callable[[pb.LeaseReply], None]) -> None:
        ended = (grpc.StatusCode.OK, "the server ended it")
        try:
            for reply in call:
                on_reply(reply)
                self.answered.set()
        except grpc.RpcError as exc:
            ended = (exc.code(), details_of(exc))
            closing.unlink(exc)
        except Exception as exc:  # noqa: BLE001 - whatever it was, the stream is over
            ended = (grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")
        self.ended_at = time.monotonic()
        self.ended = ended
        self.answered.set()

    def close(self) -> None:
        """Ends the stream (after the lease's release: a stream ended alone reads as a death
        on the server) and waits, bounded, for its thread."""
        # as a session's: bounded, and the call let go while the threads run
        closing.bounded(closing.let_go(self, "_call"), "cancelling a lease stream")
        if self._thread is not threading.current_thread():
            self._thread.join(closing.step_s())
