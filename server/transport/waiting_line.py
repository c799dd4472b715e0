"""Session calls that may wait, past the admission gate's bounds: kept in line for a thread,
not refused (server/rpc/admission.py, server/transport/sessions.py).

A call that may wait (a slot read before every contribution, a Step before every push, a
pull of a future version) holds a handler thread while it waits, so the gate lets in at
most ``--workers`` less ``--reserved-workers`` of them (112 by default), and half of that
for one token (56). Refused "retry later", the ranks past the bound asked again after
jittered pauses of up to 1 s each: an all-reduce of 150 ranks of one job, each with a
session, through one server took 0.80-0.84 s a round, against 0.29-0.44 s with a thread for
every read; in line, 0.27-0.40 s (``python -m benchmarks.leases --reads``).

A call of a session holds no thread until it runs, so past the gate it waits here instead,
in line behind its caller's earlier calls (one line per token, all read tokens in one, as
the gate counts them). Whenever a call leaves the gate (``CallGate.on_left``; any call, as
the gate's bound on threads counts the calls that do not wait too), the line's heads that the
gate now admits go to the pool, each caller's line in turn, so one token's calls never hold
back another's. What a call in line holds is bounded where it was taken: its session counts
it in flight and waiting (``MAX_WAITING`` a session) and its request bytes as held. A call
whose deadline passes in line is answered DEADLINE_EXCEEDED by the server's sweep
(``expire``); one admitted later runs with the time it has left. Unary calls hold their gRPC
thread from their arrival, so they are still refused past the bounds.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from paramshard.server.rpc.admission import CallGate
from paramshard.server.transport.session_calls import SessionJob, status_reply

__all__ = ["InLine", "WaitingLine"]


@dataclass
class InLine:
    """One session call waiting for the gate: its session and the job the session runs once
    the gate admits it (``job.waits``: the role the gate counts it as)."""

    session: Any
    job: SessionJob

    @property
    def role(self) -> str | None:
        return self.job.waits


class WaitingLine:
    """The line of one server's session calls that wait for the gate; ``start(entry)`` hands
    an admitted one to the pool."""

    def __init__(self, gate: CallGate, start: Callable[[InLine], None]) -> None:
        self.gate = gate
        self.start = start
        self._lock = threading.Lock()
        self._lines: OrderedDict[str | None, deque[InLine]] = OrderedDict()
        self.admitted_later = 0  # calls that waited here, then ran (tests and metrics)
        self._closed = False
        self._stopping: str | None = None  # why, once ``stop`` ran
        gate.on_left = self.admit

    def stop(self, why: str) -> None:
        """The server is stopping (``Sessions.drain``): no call in line starts any more; each
        is answered UNAVAILABLE with ``why`` (it never ran: its client sends it again), so
        its session ends now instead of holding the server's stop, and its call cannot start
        after the server's waits were ended (it would wait out its whole deadline)."""
        with self._lock:
            self._stopping = why
            gone = [entry for line in self._lines.values() for entry in line]
            self._lines.clear()
        for entry in gone:
            _answer(entry, grpc.StatusCode.UNAVAILABLE, why)

    def close(self) -> None:
        """The server stops: the calls in line are dropped (their streams end with it), and
        calls that leave the gate afterwards start none."""
        with self._lock:
            self._closed = True
            self._lines.clear()

    def drop(self, session: Any) -> None:
        """``session`` ended (its stream is gone): its calls in line end now, unrun, and
        their request bytes go with them."""
        with self._lock:
            gone = []
            for key in list(self._lines):
                line = self._lines[key]
                mine = [entry for entry in line if entry.session is session]
                if mine:
                    gone += mine
                    line = deque(entry for entry in line if entry.session is not session)
                    if line:
                        self._lines[key] = line
                    else:
                        del self._lines[key]
        for entry in gone:
            session.call_ended(entry.role, entry.job.received)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(line) for line in self._lines.values())

    def enter(self, entry: InLine) -> bool:
        """Admits ``entry`` through the gate now (True: the caller starts it) or puts it in
        line (False). A caller with calls in line goes behind them. Once the server is
        stopping, it is answered as those in line were (``stop``)."""
        key = self._key(entry)
        with self._lock:
            stopping = self._stopping
            if stopping is None:
                if (
                    not self._lines.get(key)
                    and self.gate.enter(entry.role, entry.session.caller) is None
                ):
                    return True
                self._lines.setdefault(key, deque()).append(entry)
        if stopping is not None:  # taken just before the server began to stop
            _answer(entry, grpc.StatusCode.UNAVAILABLE, stopping)
        return False

    def admit(self) -> None:
        """Starts the calls in line that the gate admits now: each caller's, in turn, from
        its first; a caller the gate refuses keeps its place."""
        started: list[InLine] = []
        with self._lock:
            if self._closed or self._stopping is not None or not self._lines:
                return
            first = next(iter(self._lines))
            for key in list(self._lines):
                line = self._lines[key]
                while line:
                    head = line[0]
                    if head.session.stopped:  # nobody reads its reply any more
                        line.popleft()
                        head.session.call_ended(head.role, head.job.received)
                        continue
                    if self.gate.enter(head.role, head.session.caller) is not None:
                        break
                    started.append(line.popleft())
                if not line:
                    del self._lines[key]
            if first in self._lines:
                self._lines.move_to_end(first)  # the next caller's line goes first next time
            self.admitted_later += len(started)
        for entry in started:
            self.start(entry)

    def expire(self) -> None:
        """Answers DEADLINE_EXCEEDED to the calls whose deadline passed in line, and drops
        those whose session ended (the server's sweep)."""
        now = time.monotonic()
        gone: list[InLine] = []
        with self._lock:
            for key in list(self._lines):
                kept: deque[InLine] = deque()
                for entry in self._lines[key]:
                    (gone if _over(entry, now) else kept).append(entry)
                if kept:
                    self._lines[key] = kept
                else:
                    del self._lines[key]
        for entry in gone:
            details = (
                f"{entry.job.method}: its deadline passed while it waited for a thread: every"
                " thread waiting calls may take was busy (paramshard serve --workers)"
            )
            _answer(entry, grpc.StatusCode.DEADLINE_EXCEEDED, details)

    @staticmethod
    def _key(entry: InLine) -> str | None:
        """One line per token, as the gate bounds them; read tokens share one."""
        return "\0read" if entry.role == "read" else entry.session.caller


def _answer(entry: InLine, code: grpc.StatusCode, details: str) -> None:
    """Ends a call that left the line without running: answered ``code`` if its session is
    still read."""
    s, job = entry.session, entry.job
    s.call_ended(job.waits, job.received)
    if not s.stopped:
        s.put(1, status_reply(job.call_id, code, details), promised=job.promised)


def _over(entry: InLine, now: float) -> bool:
    deadline = entry.job.deadline
    return entry.session.stopped or (deadline is not None and deadline <= now)
