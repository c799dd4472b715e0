"""``HoldLease``: a rank's open stream to this server, the kernel-level half of its lease
(server/collectives/leases.py).

The stream holds the lease while its connection lives, and what keeps a connection alive is
the two hosts' TCP stacks, not the rank's Python code. So the three ways a rank can go quiet
look different here:

- its process is stopped (SIGSTOP, swapped out), pauses in a long GC or holds the GIL: its
  socket stays open and its kernel acknowledges what this server sends; the stream stays open
  however long that lasts, and the lease holds;
- its process dies: its kernel closes the socket (FIN or RST), gRPC ends the stream at once,
  and the lease lapses ``STREAM_GRACE_S`` later unless the rank holds or renews again;
- its host vanishes or the network between is cut: nothing comes back at all. The stream sends
  a heartbeat every ``HEARTBEAT_S``; unacknowledged data makes the kernel close the connection
  after the server's TCP user timeout (server/app.py), and the stream ends as above.

Each stream also carries the run's abort notices as they are raised, so the other ranks learn
at once rather than at their next renewal. A stream holds one of the server's session threads
while it is open (server/rpc/admission.py counts it as a session).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.leases import LeaseTable

__all__ = ["HEARTBEAT_S", "MAX_WAITING", "Hold", "hold_lease"]

HEARTBEAT_S = 5.0
"""How often an open stream sends an empty reply: data the client's kernel must acknowledge,
so a vanished host is found by the TCP user timeout even when no notice is sent."""
_STOP = object()  # the server stops
_WAKE = object()  # the call ended: look at the context


MAX_WAITING = 64
"""Notices a stream keeps for its rank while the rank does not read them; beyond, the oldest
is dropped. A notice only hurries what the rank's next renewal or call tells it anyway, and a
rank that never reads must not make the server keep every notice of its run."""


class Hold:
    """One open stream: the replies waiting to be sent to rank ``rank`` of run ``run``."""

    def __init__(self, run: str, rank: int) -> None:
        self.run, self.rank = run, rank
        self._out: deque[Any] = deque()
        self._cond = threading.Condition()
        self.dropped = 0  # notices dropped, the oldest first, while the rank did not read

    def push(self, reply: pb.LeaseReply) -> None:
        with self._cond:
            waiting = [i for i, item in enumerate(self._out) if isinstance(item, pb.LeaseReply)]
            if len(waiting) >= MAX_WAITING:
                del self._out[waiting[0]]
                self.dropped += 1
            self._put(reply)

    def stop(self) -> None:
        with self._cond:
            self._put(_STOP)

    def wake(self) -> None:
        with self._cond:
            self._put(_WAKE)

    def _put(self, item: Any) -> None:
        self._out.append(item)
        self._cond.notify()

    def next(self, timeout: float) -> Any:
        with self._cond:
            if not self._out:
                self._cond.wait(timeout)
            return self._out.popleft() if self._out else None


def hold_lease(
    table: LeaseTable, req: pb.LeaseRequest, context: Any, owner: str | None = None
) -> Iterator[pb.LeaseReply]:
    """The ``HoldLease`` handler: checks and holds the lease now (a bad request fails here,
    before the stream opens), then streams the run's notices and heartbeats until the call
    ends or the server stops. ``owner``: the caller (``LeaseTable.renew``)."""
    hold = Hold(req.run, req.rank)
    first = table.open_hold(req, hold, owner)
    context.add_callback(hold.wake)  # the call ended (cancelled, connection closed)
    return _replies(table, hold, first, context)


def _replies(table: LeaseTable, hold: Hold, first: pb.LeaseReply, context: Any) -> Iterator[Any]:
    try:
        yield first
        while True:
            item = hold.next(HEARTBEAT_S)
            if item is _STOP or not context.is_active():
                return
            if item is not _WAKE:
                yield item if item is not None else pb.LeaseReply(lost_rank=-1)
    finally:
        # A generator closed by gRPC (its call ended while it yielded) ends here too. The
        # lapse check at the end of the rank's grace is not waited for here: handler threads
        # are few (server/collectives/lease_checks.py).
        if table.end_hold(hold):
            table.check_later(hold.run)
