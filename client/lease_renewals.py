"""A rank's renewals of its lease (client/leases.py): which servers are due, sending them,
and taking their answers.

The process's renewing thread (client/lease_keeper.py) calls ``send_due`` and ``collect`` each
round. A renewal may wait in a busy server as long as the rank's pace there
(``renewal_pace``), and no second one goes to that server while it waits; the thread takes
the answers that come within its round and leaves the others in flight, so a server that
answers late delays no other lease of the process. ``renew`` renews everywhere now and waits
(a new client's servers without a stream, ``RunState.refresh``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from paramshard.client.lease_holds import HoldStream
from paramshard.client.lease_keeper import RENEW_S, renewal_pace
from paramshard.client.server_loss import ServerLoss
from paramshard.protos import shard_pb2 as pb

__all__ = ["Renewals"]


class Renewals(ServerLoss):
    """Mixed into a rank's lease (``_Holding`` in client/leases.py), whose attributes these
    read and keep: its streams, the servers' answers and the renewals in flight."""

    world_size: int
    holds: dict[int, HoldStream]
    answered: dict[int, tuple[float, int]]  # server -> (sent at, epoch) of its last answer
    # server -> the renewal in flight there: (future, (sent at, epoch), when to drop it)
    _in_flight: dict[int, tuple[Any, tuple[float, int], float]]
    _lock: threading.Lock
    released: bool

    _request: Callable[..., pb.LeaseRequest]  # the lease's own: a request of this rank
    take_reply: Callable[[pb.LeaseReply], None]  # the lease's own: a server's answer

    def renewals(self, paced: bool = False) -> dict[int, pb.LeaseRequest]:
        """A renewal per server (``paced``: per server that is due, ``_due``), each saying
        whether this rank holds a stream there (empty once released). Both are read at one
        moment, so a renewal that goes out after the release (from the renewing thread, which
        read this before) still claims the streams the release closed: the server then gives it
        no TTL (server/collectives/leases.py, UNSEEN_END_S)."""
        with self._lock:
            if self.released:
                return {}
            streams = {i for i, hold in self.holds.items() if hold.open}
        client = self.client()
        servers = range(client.num_servers) if client is not None else ()
        now, epoch = time.monotonic(), self.state.epoch
        return {
            i: self._request(stream=i in streams)
            for i in servers
            if not paced or self._due(i, i in streams, now, epoch)
        }

    def _due(self, server: int, streamed: bool, now: float, epoch: int) -> bool:
        """Whether ``server`` gets a renewal now at this rank's pace (``RENEWALS_A_SECOND``):
        at once if its last one failed, went at another epoch or its stream broke."""
        last = self.answered.get(server)
        if last is None or last[1] != epoch or server in self.stream_lost:
            return True
        pace = renewal_pace(self.world_size, self.ttl_s, streamed)
        return now - last[0] >= pace - RENEW_S / 2  # the renewing thread wakes every RENEW_S

    def _send(
        self, requests: dict[int, pb.LeaseRequest], deadline_s: Any = None
    ) -> list[tuple[int, Any]]:
        """Sends each request of ``requests`` (server -> request) at once: (server, future).
        ``deadline_s(request)`` gives each call's deadline; default ``_call_s``."""
        client = self.client()
        if client is None or client.closed:
            return []
        sent = []
        for i, req in requests.items():
            if i in self.silenced:
                continue
            timeout = deadline_s(req) if deadline_s is not None else self._call_s()
            try:
                stub = client.stub(i, "Lease")
                fut = stub.future(req, timeout=timeout, metadata=client.spec.metadata())
            except ValueError:  # the channel was closed under us
                return sent
            sent.append((i, fut))
        return sent

    def _call_s(self) -> float:
        """The deadline of a lease call that is waited for (a release, an abort, a renewal
        asked for now): at most ``RENEW_S``."""
        return max(0.2, min(RENEW_S, self.ttl_s / 2))

    def start(self, request: pb.LeaseRequest | None = None) -> list[tuple[int, Any]]:
        """Sends ``request`` (default: a renewal) to every server at once: (server, future)."""
        client = self.client()
        if client is None:
            return []
        if request is None:
            return self._send(self.renewals())
        return self._send(dict.fromkeys(range(client.num_servers), request))

    def send_due(self) -> None:
        """The renewing thread's round: a renewal to every server that is due (``_due``) and
        has none in flight. Its deadline is the rank's pace there (``renewal_pace``, at least
        ``_call_s``): a renewal that waits in a busy server's queue still lands, and a server
        that falls behind is not sent more renewals than one that keeps up (before, a renewal
        had 1 s, and one that timed out was sent again a second later: a rank without a
        stream there asked five times as often as its pace, on the server that was behind)."""
        epoch = self.state.epoch
        with self._lock:  # one of an earlier epoch is not waited for: the servers hear the new
            flying = {i for i, (_, sending, _) in self._in_flight.items() if sending[1] == epoch}
        requests = {i: r for i, r in self.renewals(paced=True).items() if i not in flying}
        now = time.monotonic()
        sent = self._send(requests, self._renewal_s)
        with self._lock:
            if self.released:  # released meanwhile: its release did not see these
                stray = [fut for _, fut in sent]
            else:
                stray = []
                for i, fut in sent:
                    give_up_at = now + self._renewal_s(requests[i]) + 2 * RENEW_S
                    self._in_flight[i] = (fut, (now, requests[i].epoch), give_up_at)
        for fut in stray:
            fut.cancel()

    def _renewal_s(self, request: pb.LeaseRequest) -> float:
        """The deadline of paced renewal ``request``: the rank's pace where it goes."""
        return max(self._call_s(), renewal_pace(self.world_size, self.ttl_s, request.stream))

    def collect(self, until: float) -> None:
        """Takes the answers of the renewals in flight that come by ``until`` (monotonic
        seconds); the others stay in flight. One still not done ``2 * RENEW_S`` past its
        deadline sits in a channel stuck in gRPC (protos/closing.py): it is dropped, and the
        server asked again."""
        with self._lock:
            flying = list(self._in_flight.items())
        for i, (fut, sending, give_up_at) in flying:
            if not _settled(fut, until - time.monotonic()):
                if time.monotonic() < give_up_at:
                    continue
                fut.cancel()
                self.answered.pop(i, None)
            else:
                self._took(i, fut, sending)
            with self._lock:
                if self._in_flight.get(i, (None,))[0] is fut:
                    del self._in_flight[i]

    def _took(self, server: int, fut: Any, sending: tuple[float, int]) -> None:
        """Takes the answer of renewal ``fut`` (done), sent to ``server`` at ``sending``
        (monotonic seconds, epoch): notices, lost servers."""
        now = time.monotonic()
        try:
            reply = fut.result(timeout=0)
        except grpc.RpcError as exc:
            self.answered.pop(server, None)
            self._failed(server, exc, now)
            if server in self.full:
                self.answered[server] = sending  # a full server is asked at the rank's pace
            return
        except grpc.FutureCancelledError:  # released, or cut off at the process's exit
            self.answered.pop(server, None)
            return
        self.answered[server] = sending
        self.failing_since.pop(server, None)
        self.full.discard(server)
        self.take_reply(reply)
        self._answered_as(server, reply.incarnation)

    def renew(self) -> None:
        """Renews on every server now and takes the answers (``RunState.refresh``; a new
        client's servers where it holds no stream)."""
        now, epoch = time.monotonic(), self.state.epoch
        deadline = now + 2 * RENEW_S  # the calls' deadline is at most RENEW_S
        for i, fut in self.start():
            if _settled(fut, deadline - time.monotonic()):
                self._took(i, fut, (now, epoch))
            else:  # a channel stuck in gRPC (protos/closing.py)
                self.answered.pop(i, None)


def _settled(fut: Any, timeout: float) -> bool:
    """Whether lease call ``fut`` is done, waiting ``timeout`` seconds at most."""
    try:
        fut.result(timeout=max(0.0, timeout))
    except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
        pass
    return fut.done()
