"""Releases that a closed client could not see answered, sent again before the same process's
next client of the same run leases.

A client's ``close()`` waits for its release at most ``closing.STEP_S``, and a call that timed
out on the client may still run on its server later. So on a loaded machine, a script that runs
one job twice under one run id (a loop, a notebook) could lease the rank again before the first
run's release reached the server. The server then could not tell the runs apart: it forgets a
run whose ranks released (server/collectives/leases.py, ``_ended``), and here they had not yet,
so the second run met the first one's keys and failed at its first collective. Now the next
client of the run sends the run's unanswered releases again and waits for their answers
(``AGAIN_S`` at most) before it leases; a first copy that comes later still drops nothing
(server/collectives/lease_requests.py, ``superseded``). The next job in another process has
no such list; there the old run ends when no live process is behind its leases
(``abandoned``, same file).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc

from paramshard.client.lease_holds import CONFLICT
from paramshard.protos import closing
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.service import method_path
from paramshard.protos.words import details_of

__all__ = ["AGAIN_S", "FORGET_S", "HELD_PACE_S", "KEPT", "await_release", "post", "send_again"]

log = logging.getLogger(__name__)

AGAIN_S = 5.0
"""How long the next client waits for the answers to the releases it sends again: a server
that answers none in that time is down or stopped, and the next client goes on (its lease then
takes the rank over, and the old release drops nothing when it comes)."""
KEPT = 256
"""Releases kept unanswered at most (the oldest go first): one per rank a process ran."""
FORGET_S = 120.0
"""A release older than this is not sent again: it reached its server long ago, or the server
is gone."""

HELD_PACE_S = 0.1
"""How often ``post`` asks again a server that still holds the rank's lease stream. The rank's
process has exited, so its connection is closed, but the server may not have handled the
stream's end yet when the call comes: it then refuses the call as from another process
(ALREADY_EXISTS, server/collectives/lease_requests.py ``check_holder``). Taken once, that
refusal left the rank's peers on other hosts to wait for a restart that never comes."""
_LEASE = method_path("Lease")

_lock = threading.Lock()
_unanswered: dict[tuple[str, int], tuple[float, pb.LeaseRequest, frozenset[str]]] = {}
_sending: dict[str, threading.Event] = {}  # run -> set when its releases were sent again


def _answered(fut: Any) -> bool:
    """Whether a release call is known to have reached its server: answered, or refused
    because another process holds the rank (nothing of this process's is there to release)."""
    if not fut.done() or fut.cancelled():
        return False
    error = fut.exception()
    return error is None or (isinstance(error, grpc.Call) and error.code() == CONFLICT)


def _wait(futures: list[Any], bound_s: float) -> None:
    """Waits for ``futures`` (release calls), ``bound_s`` at most in all."""
    deadline = time.monotonic() + bound_s
    for fut in futures:
        try:
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
            pass


def await_release(client: Any, request: pb.LeaseRequest, sent: list[tuple[int, Any]]) -> None:
    """Waits ``closing.STEP_S`` at most in all for release ``request``, sent to ``client``'s
    servers as ``sent`` (server, future), and keeps it for the process's next client of the
    rank if some server did not answer."""
    _wait([fut for _, fut in sent], closing.STEP_S)
    if client is not None:
        _note(request, [client.spec.addresses[i] for i, fut in sent if not _answered(fut)])


def _note(request: pb.LeaseRequest, addresses: list[str]) -> None:
    """Release ``request`` was not seen answered by the servers at ``addresses``."""
    key = (request.run, request.rank)
    with _lock:
        _unanswered.pop(key, None)
        if addresses:
            _unanswered[key] = (time.monotonic(), request, frozenset(addresses))
        while len(_unanswered) > KEPT:
            del _unanswered[next(iter(_unanswered))]


def send_again(client: Any, run: str) -> None:
    """Before ``client`` leases a rank of run ``run``: sends the unanswered releases of the
    run's earlier clients in this process again, to those of their servers that ``client`` has,
    and waits for the answers (``AGAIN_S`` at most). Every rank's, not only its own: a run
    whose ranks all released is forgotten when the next one leases, and a rank of the next run
    that leased before an old rank's release came would keep the old run. A client that comes
    while another sends waits for it."""
    kept: list[tuple[pb.LeaseRequest, frozenset[str]]] = []
    with _lock:
        busy = _sending.get(run)
        if busy is None:
            now = time.monotonic()
            for key in [k for k in _unanswered if k[0] == run]:
                at, request, addresses = _unanswered.pop(key)
                if now - at < FORGET_S:
                    kept.append((request, addresses))
            if not kept:
                return
            busy = _sending[run] = threading.Event()
    if not kept:
        busy.wait(AGAIN_S)
        return
    try:
        _send(client, kept)
    finally:
        with _lock:
            del _sending[run]
        busy.set()


def _send(client: Any, kept: list[tuple[pb.LeaseRequest, frozenset[str]]]) -> None:
    metadata = client.spec.metadata()
    sent = [
        (i, request, client.stub(i, "Lease").future(request, timeout=AGAIN_S, metadata=metadata))
        for request, addresses in kept
        for i, address in enumerate(client.spec.addresses)
        if address in addresses
    ]
    _wait([fut for _, _, fut in sent], AGAIN_S)
    for i, request, fut in sent:
        if not _answered(fut):
            log.warning(
                "run '%s': an earlier client of this process for rank %d released its lease,"
                " and server %s answered neither that release nor, in %g s, the same again;"
                " leasing anyway (if that run had ended, this one may meet its keys there)",
                request.run,
                request.rank,
                client.spec.addresses[i],
                AGAIN_S,
            )


def post(spec: Any, request: pb.LeaseRequest, bound_s: float) -> list[str]:
    """Sends ``request``, a release that says what became of a rank whose process is gone or
    going (it ended for good; it stopped on an error: the run's final notice), to every
    server of ``spec`` in turn, ``bound_s`` at most in all; returns what failed ("ADDRESS:
    CODE: details"), empty when every server took it. A server that still holds the rank's
    stream is asked again (``HELD_PACE_S``). The launcher sends these for its ranks
    (paramshard/finished_ranks.py), and so does a rank's exit after its script closed the
    client (client/leases.py)."""
    deadline = time.monotonic() + bound_s
    failed = []
    for i, address in enumerate(spec.addresses):
        call = spec.channel(i).unary_unary(
            _LEASE,
            request_serializer=pb.LeaseRequest.SerializeToString,
            response_deserializer=pb.LeaseReply.FromString,
        )
        while True:
            try:
                left = max(0.1, deadline - time.monotonic())
                call(request, timeout=left, metadata=spec.metadata())
                break
            except grpc.RpcError as exc:
                held = exc.code() == CONFLICT
                if held and time.monotonic() + HELD_PACE_S < deadline:
                    time.sleep(HELD_PACE_S)  # its stream's end is on its way
                    continue
                failed.append(f"{address}: {exc.code().name}: {details_of(exc)}")
                break
    return failed
