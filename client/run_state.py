"""What a client and its views share about their run (client/leases.py keeps it current): the
epoch, the abort notice a server raised, and the calls in flight that notice cancels."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from paramshard.client import restarts

__all__ = ["FINAL", "Holding", "Notice", "RunState", "WAITS_ON_PEERS"]

log = logging.getLogger("paramshard.leases")

WAITS_ON_PEERS = frozenset(
    {"PushGrad", "PullParams", "GradNorm", "Step", "Contribute", "ReadSlot", "ContributeRead"}
)
"""The calls whose outcome depends on other ranks: refused once the run's epoch is aborted."""
SAID_AT_MOST, SAID_WINDOW_S = 10, 10.0
"""Notices a client logs in a window of seconds; the rest it counts (``RunState._say``)."""
FINAL = 1 << 32
"""The epoch of a notice that ends every epoch (``RunState.refuse``): above any a rank has."""


class Holding(Protocol):
    """A rank's lease on its servers, as the run state uses it (client/leases.py)."""

    rejoin_s: float

    def post_abort(self, cause: str) -> str | None: ...

    def renew(self) -> None: ...


@dataclass(frozen=True)
class Notice:
    """A run's epoch was aborted: why, which epoch, and the rank lost (-1: none); ``final``:
    this rank may not take part at all (``RunState.refuse``)."""

    reason: str
    epoch: int
    lost_rank: int = -1
    final: bool = False

    @property
    def recoverable(self) -> bool:
        """Whether the surviving ranks can go on (a lost server: restore and replay), as
        opposed to a lost trainer, whose process and state are gone."""
        return self.lost_rank < 0 and not self.final

    def ended_call(self, sent: bool) -> str:
        """The details of a call this notice ended here (``sent``: cancelled while it waited,
        else never sent). They say where the notice came from: the error names the called
        server, which had not answered (a field check: "server 1 ... PushGrad: ABORTED: ...
        rank 1 lost" on the surviving host, server 1 being on the host that died)."""
        how = "cancelled while it waited" if sent else "not sent"
        came = "the run's notice, through this rank's lease (not this server's answer)"
        return f"{how}: {came}: {self.reason}"


class RunState:
    """What a client and its views (groups, ``on_servers``) share about their run: the epoch,
    the abort notice, and the calls in flight a notice cancels."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.epoch = 0
        self.notice: Notice | None = None
        self._in_flight: set[Any] = set()
        self.holding: Holding | None = None
        self.fail_fast = False  # give up the epoch when a server stops answering renewals
        self.ended_run = False  # this rank posted a final notice (``give_up(..., final=True)``)
        self.elastic = False  # an elastic membership's: a rank that raises leaves the job
        self._said: deque[float] = deque(maxlen=SAID_AT_MOST)  # when notices were logged
        self._unsaid = 0  # notices not logged since (past the bound)
        self.took_over = False
        """A server said this process holds the rank in place of an earlier process of the run
        (``LeaseReply.took_over``): a restart, even one its launcher does not count (a node's
        launch command run again by hand)."""

    def current(self) -> Notice | None:
        """The notice when it applies to this client's epoch, else None."""
        notice = self.notice
        return notice if notice is not None and notice.epoch >= self.epoch else None

    def advance(self, epoch: int) -> None:
        """The client moved to epoch ``epoch`` (``restart_collectives``)."""
        with self._lock:
            self.epoch = max(self.epoch, epoch)

    def next_epoch(self, notice: Notice | None) -> int:
        """The epoch a recovery moves to: past this client's and past ``notice``'s (the one
        that ended the epoch; the same on every rank that saw it). None follows the run's
        final notice: ValueError, where its epoch (``FINAL``) + 1 would fail every lease."""
        if notice is not None and notice.final:
            raise ValueError(f"no recovery follows the run's final notice: {notice.reason}")
        return max(self.epoch, notice.epoch if notice is not None else 0) + 1

    def track(self, future: Any) -> None:
        """Registers a call in flight, until it completes."""
        with self._lock:
            self._in_flight.add(future)
            late = self.current() is not None  # a notice came after the caller checked
        future.add_done_callback(self._done)
        if late:
            future.cancel()

    def _done(self, future: Any) -> None:
        with self._lock:
            self._in_flight.discard(future)

    def abort(self, notice: Notice, say: bool = True) -> bool:
        """Takes ``notice`` and cancels the calls in flight, if it applies to this epoch; logs
        it unless not ``say`` (the caller raises it). Whether it took it (not an epoch
        ended already, nor the notice it has)."""
        with self._lock:
            if notice.epoch < self.epoch or self.notice == notice:
                return False
            if self.notice is not None and self.notice.epoch >= notice.epoch:
                return False  # that epoch ended already
            self.notice = notice
            pending = list(self._in_flight)
        if say:
            self._say(notice)
        for future in pending:
            future.cancel()
        return True

    def _say(self, notice: Notice) -> None:
        """Logs a notice taken, at most ``SAID_AT_MOST`` in ``SAID_WINDOW_S`` (the rest
        counted in the next one logged): a run has a handful, and a lying server's lease stream
        of notices for epochs 1, 2, 3, ... logged 9,909 warnings in 2 s."""
        now = time.monotonic()
        with self._lock:
            if len(self._said) == SAID_AT_MOST and now - self._said[0] < SAID_WINDOW_S:
                self._unsaid += 1
                return
            self._said.append(now)
            unsaid, self._unsaid = self._unsaid, 0
        more = f" ({unsaid:,} notices before it not shown)" if unsaid else ""
        log.warning("%s%s", notice.reason, more)

    def give_up(self, cause: str, final: bool = False) -> None:
        """This rank abandons its epoch (it lost a server, it recovers): the others' waits end
        at once. ``cause`` reads after the rank's name in the servers' notice ("run 'R': rank 1
        " + "recovers: server 2 ... lost"; "gives up: job 'J' cannot be recovered: ...").
        ``final``: the run cannot go on (its job is lost): the others stop rather than recover
        (before, they recovered again and again, each time waiting out their timeout for this
        rank)."""
        holding = self.holding
        self.ended_run = self.ended_run or final  # before the servers echo it back
        reason = holding.post_abort(cause, final) if holding is not None else None
        epoch = FINAL if final else self.epoch
        self.abort(Notice(reason or f"this rank {cause}", epoch, final=final))

    def stop_on_error(self, why: str, cause: str) -> None:
        """This rank's own code raised (``why``: one line) and nothing here recovers it. A rank
        its launcher may restart (its lease's ``rejoin_s``) tells the launcher why and stops
        nobody: the others wait for its restart. Nor does one whose torchrun restarts every
        worker (``group_restarts_left``): a final notice would call an error that the restart
        mends the run's end (a field check: the job resumed all the same). Any other tells the
        launcher, then posts the run's final notice (``cause``, as ``give_up`` words it), so
        the others stop now."""
        if self.holding is not None and self.holding.rejoin_s:
            restarts.declare_error(why)
            return
        if left := restarts.group_restarts_left():
            log.warning(
                "%s; torchrun restarts every worker of the job (%d of its --max-restarts left),"
                " so this rank stops nobody",
                why,
                left,
            )
            return
        restarts.declare_failed(why)  # for the launcher, before the others stop
        self.give_up(cause, final=True)

    def refuse(self, reason: str, say: bool = True) -> None:
        """The servers refuse this rank for good (another process holds it: two jobs share the
        run id): every call that waits for other ranks fails with ``reason`` from now on, at
        every epoch, and nothing recovers from it. Logged unless not ``say``."""
        self.abort(Notice(reason, FINAL, final=True), say)

    def cannot_rejoin(self) -> None:
        """This rank keeps state in its process (DDP, 3D): were it lost, the others must not
        wait for a restart."""
        if self.holding is not None:
            self.holding.rejoin_s = 0.0

    def refresh(self) -> Notice | None:
        """Asks the servers now (one renewal), then ``current()``."""
        if self.holding is not None:
            self.holding.renew()
        return self.current()
