"""Which of a rank's servers are lost, as its lease's renewals tell (client/leases.py): one
whose renewals fail (its process died: its stream ended too; or it vanished), and one that
answers as another process than it did earlier in the epoch (it restarted, empty). Under
``train_with_recovery`` (``RunState.fail_fast``) the rank then gives up its epoch, and every
rank recovers at once."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

from paramshard.client.lease_holds import CONFLICT
from paramshard.client.run_state import RunState
from paramshard.protos.words import details_of

__all__ = ["STREAM_GRACE_S", "ServerLoss"]

log = logging.getLogger("paramshard.leases")

STREAM_GRACE_S = 1.0
"""A server whose stream ended is taken for lost (under ``fail_fast``) once its renewals have
failed this long: the servers give a rank the same (server/collectives/leases.py)."""

_FAILING = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,  # a server that stops cancels the calls it runs
)


class ServerLoss:
    """Mixed into a rank's lease (``_Holding`` in client/leases.py), whose attributes these
    read: its run state, client, TTL and the servers' bookkeeping."""

    state: RunState
    ttl_s: float
    takeover_until: float
    failing_since: dict[int, tuple[float, int]]
    full: set[int]
    silenced: set[int]
    stream_lost: set[int]
    incarnations: dict[int, tuple[int, int]]  # server -> (its process, epoch last seen in)

    client: Callable[[], Any]  # the rank's client (a weak reference)
    refuse: Callable[[int, str], None]  # the lease's own: another process holds this rank

    def _failed(self, server: int, exc: grpc.RpcError, now: float) -> None:
        code = exc.code()
        if code == CONFLICT:
            if now >= self.takeover_until:
                self.refuse(server, details_of(exc))
            return
        if code not in _FAILING:
            # an older server, a token without the train role: no lease there (the calls will
            # say what is wrong); a full one: none for now
            full = code == grpc.StatusCode.RESOURCE_EXHAUSTED
            if server not in self.full:
                later = " for now (asked again at each renewal)" if full else ""
                log.warning(
                    "no lease on server %d%s: %s: %s", server, later, code.name, details_of(exc)
                )
            (self.full if full else self.silenced).add(server)
            return
        since, epoch = self.failing_since.setdefault(server, (now, self.state.epoch))
        # a server whose process died broke its stream too: it is not coming back soon
        patience = STREAM_GRACE_S if server in self.stream_lost else self.ttl_s
        if now - since < patience or epoch != self.state.epoch or self.state.current():
            return
        self._lost(server, f"lost: unreachable for {now - since:.1f} s ({code.name})")

    def _answered_as(self, server: int, incarnation: int) -> None:
        """``server`` answered as process ``incarnation``: another one than it last answered
        as in this epoch restarted since, empty. (One last seen in an earlier epoch was lost
        before this epoch's recovery began, which restores it.)"""
        epoch = self.state.epoch
        before, seen_in = self.incarnations.get(server, (incarnation, epoch))
        self.incarnations[server] = (incarnation, epoch)
        if before != incarnation and seen_in == epoch and not self.state.current():
            self._lost(server, "lost: it restarted, empty (another process answers)")

    def _lost(self, server: int, why: str) -> None:
        """Gives up this rank's epoch for ``server`` (a rank in ``train_with_recovery``: it
        recovers at once, and the others with it): a server that stopped answering, or one
        that answers as a new process (``LeaseReply.incarnation``), which a rank waiting on
        another server's call would not meet (a node down: the rank that would, died with it)."""
        if not self.state.fail_fast:
            return  # the calls' own retries and errors decide what this rank does
        client = self.client()
        address = client.spec.addresses[server] if client is not None else "?"
        self.state.give_up(f"recovers: server {server} ({address}) {why}")
