"""The order a batch of calls goes out in (``RpcCore.run``): each server's calls in turn,
a few at a time to a server whose payloads travel through shared segments.

A batch often holds the chunks of several servers one server after the other (a pull walks
the slices in order). Sent in that order, all of a client's ``max_in_flight`` calls go to one
server at once, and each server's pool of shared segments (protos/shm.py) grows to the whole
window: ``max_in_flight`` chunks per trainer and server on the host, kept for the segments'
life. Taken a server at a time in turn, the window spreads over the servers, which also work
on it at once. A batch that still goes mostly to one server (a pull of one large tensor, a
bucket inside one server's slice) sends it a second call only while the client's calls
with segments to that server, all its batches together, are fewer than 2
(``SharedMemory.has_room``; no bound to a server elsewhere or in this process), and takes
later calls of other servers meanwhile. Its first call to a server always goes: a batch
waits only on its own calls, never on another batch's.

Only the order between servers changes: each server's calls keep their order, and a run of
calls of one method never mixes with the next one. A reduce-scatter queues its contributions
before the ContributeRead of its own slice (client/collectives.py), so a window full of
waiting calls never holds back a contribution another rank waits for; a call held back for its
server's bound therefore lets later calls of its own run go ahead, never those of the next
run, unless its method is one of ``IN_ORDER`` (an all-reduce's ContributeRead calls). Replies
still come back in the batch's order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["in_turn", "Batch", "IN_ORDER"]

IN_ORDER = frozenset({"ContributeRead"})
"""Methods whose calls go out strictly in the batch's order (after ``in_turn``): a call held
back for its server's bound holds back the ones after it. Each of these calls waits for the
other ranks' calls of its chunk, which they send in the same order: every rank's calls sent
are then the first ones of one list, and the calls of the rank furthest behind wait only for
calls every other rank sent. Taken out of order, a window full of calls that wait could hold
back a call another rank's window waits for."""


def in_turn(calls: Iterable[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """``(index, call)`` pairs reordered: within each run of consecutive calls of the same
    ``method``, one call of each server in turn (servers in the order they first appear),
    each server's calls in their own order."""
    out: list[tuple[int, Any]] = []
    run: list[tuple[int, Any]] = []
    for item in calls:
        if run and item[1].method != run[-1][1].method:
            _take_in_turn(run, out)
            run = []
        run.append(item)
    _take_in_turn(run, out)
    return out


def _take_in_turn(run: list[tuple[int, Any]], out: list[tuple[int, Any]]) -> None:
    lanes: dict[int, deque[tuple[int, Any]]] = {}
    for item in run:
        lanes.setdefault(item[1].server, deque()).append(item)
    if len(lanes) == 1:
        out += run
        return
    queues = list(lanes.values())
    while queues:
        for lane in queues:
            out.append(lane.popleft())
        queues = [lane for lane in queues if lane]


class Batch:
    """The calls of one ``RpcCore.run`` not sent yet, in turn, and how many of each server's
    are in flight; ``room(server)``: whether one more may go to ``server`` while some of this
    batch's are there (asked only then: a batch always gets its first call to a server out,
    so it never waits on another batch)."""

    def __init__(self, calls: Iterable[Any], room: Callable[[int], bool]) -> None:
        self._queue = deque(in_turn(enumerate(calls)))
        self._room = room
        self._busy: dict[int, int] = {}
        self.alone = len(self._queue) == 1

    def __bool__(self) -> bool:
        return bool(self._queue)

    def take(self) -> tuple[int, Any] | None:
        """The next call to send: the first of the head's run of one method whose server has
        room; None when none has (a call in flight must end first)."""
        head, full = self._queue[0][1].method, set()
        for k, (i, call) in enumerate(self._queue):
            if call.method != head:
                return None
            if call.server in full:
                continue
            busy = self._busy.get(call.server, 0)
            if busy and not self._room(call.server):
                if head in IN_ORDER:
                    return None
                full.add(call.server)
                continue
            del self._queue[k]
            self._busy[call.server] = busy + 1
            return i, call
        return None

    def done(self, call: Any) -> None:
        """``call`` (taken earlier) is no longer in flight."""
        self._busy[call.server] -= 1
