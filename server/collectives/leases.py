"""Trainer leases: a rank that dies is noticed in about two seconds, not at a deadline; a rank
that is only slow (a long GC pause, a loaded machine, a stopped process) is never taken for dead.

A rank holds its lease on every server in two ways (client/leases.py):

- an open ``HoldLease`` stream (server/collectives/lease_holds.py). Its connection is the
  liveness signal, kept by the operating systems, not by the rank's Python code: a process that
  is stopped, swapped out or holding the GIL keeps its sockets open and its kernel acknowledges
  what this server sends, while a process that dies has its sockets closed by its kernel at once
  (FIN or RST). So a lease whose stream is open never lapses; when the stream ends without a
  release, the lease lapses ``STREAM_GRACE_S`` later unless the rank renews or holds again
  within that time (a live client reconnects at once, a dead one never does). A host that
  vanishes sends nothing at all: the stream's heartbeats go unacknowledged and the kernel
  closes the connection after the server's TCP user timeout (server/app.py, 30 s).
- renewals (``Lease``) about every second, which carry the rank's epoch and bring back the
  run's notice. A lease with no open stream (a server at its stream bound, an older client)
  lapses a TTL after its last renewal (``PARAMSHARD_LEASE_TTL_S``, 30 s by default).

A lapse means the rank died or lost the network. Then the run's current epoch is aborted on
this server: its open reduction slots and mailboxes end with ABORTED ("run 'R' aborted: rank 3
lost ..."; "run 'R': rank 1 recovers: server 2 (ADDRESS) lost ..." when a rank asked for it), a
key of that epoch not open yet is refused the same way (``SlotStore.abort_run``), and every
renewal by a rank at that epoch or an earlier one carries the notice back
(``LeaseReply.aborted``), so the other ranks stop waiting at once: their client cancels its
calls in flight (the open streams carry the notice too, at once). A rank that lost a server
asks the others' servers to abort the epoch (``LeaseRequest.abort``), and 3D recovery starts at
once.

A lapse counts only with a *witness*: another rank of the run whose renewal reached this server
after the silence began (the stream's end, or the TTL's), and whose renewals reached it all
along (since before the silent rank was last known alive: its last renewal, or its stream's
end while a stream held its lease; or for ``ISOLATED_GRACE_S`` after they resumed). A server
cut off from every trainer hears from nobody, so it cannot tell a dead rank from its own
broken link and decides nothing; when the link comes back, the ranks' renewals resume and
nothing was aborted. (A rank that a server alone cannot hear while the others can is taken for
lost: to the run it is.) Leases that lapse with no witness are dropped silently after
``forget_s``.

A rank that may come back (``paramshard launch --max-restarts``; its lease carries
``rejoin_ms``) is awaited instead: the run is aborted only if no renewal for that rank arrives
within that time after the lapse. A restarted trainer renews the same rank.

One process a rank, and a closed client's late requests: server/collectives/lease_requests.py.

Epochs: after an abort, ranks recover under the next epoch (``restart_collectives``), which the
abort does not touch. A run whose leases are all gone is forgotten after ``forget_s``; a
renewal for a run that was aborted with no live lease left, or that ended (``ended_run``: a job
run again under its run id; ``abandoned``: all its ranks killed, none heard for ``SETTLE_S``),
starts a new run under the id, and the slot store forgets what the old one left
(``SlotStore.forget_run``): its collectives count from 1 again. Memory is bounded: at most
``max_runs`` runs, ``max_leases`` leases (RESOURCE_EXHAUSTED past either) and as many marks of
released ranks, one caller's (where tokens are on: a token's) at most half of each.

Lapses are found lazily: when a rank of the run renews (at most every ``CHECK_EVERY_S``), when
a stream's grace ends (server/collectives/lease_checks.py), and by the server's sweeper; no
thread waits per lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Protocol

from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives import lease_requests as checks
from paramshard.server.collectives import lease_words
from paramshard.server.collectives.lease_books import Books
from paramshard.server.collectives.lease_checks import DueChecks
from paramshard.server.collectives.lease_records import LeaseRecord, Listener, RunRecord, Witnesses
from paramshard.server.collectives.slot import Slot
from paramshard.server.runtime.errors import ShardError

__all__ = ["LeaseTable"]

CHECK_EVERY_S = 0.05
STREAM_GRACE_S = 1.0
"""After a rank's last stream ends without a release, how long it has to renew or hold again
before its lease lapses: a live client's channel reconnects within it, a dead process never."""
UNSEEN_END_S = 5.0
"""After a rank's last stream ended, how long renewals that still claim a stream
(``LeaseRequest.stream``) keep its lease. Such a renewal was sent before the rank saw the end:
a live rank opens a new stream at its next renewal after seeing it (``RENEW_S``, 1 s, in
client/leases.py; the rest is room for a loaded machine), while a rank that died sends nothing
more. Without this bound, a dead rank's last renewal, handled after its stream's end on a busy
server, would hold its lease for a whole TTL (30 s by default)."""
ISOLATED_GRACE_S = 10.0
"""How long renewals must have reached this server again, after it heard from no rank, before
a rank still silent is taken for lost: covers ranks whose channels reconnect later than
others' (client channels back off at most 5 s: client/cluster.py)."""


class _Aborts(Protocol):
    """What a lease table needs of the slot store."""

    def abort_run(self, run: str, epoch: int, why: str) -> int: ...

    def forget_run(self, run: str) -> int: ...

    def open_slots(self) -> list[Slot]: ...


class LeaseTable:
    """The leases of every run on this server (see the module docstring)."""

    def __init__(
        self,
        slots: _Aborts,
        *,
        forget_s: float = 600.0,
        max_runs: int = 4096,
        max_leases: int = 65536,
        clock=time.monotonic,
    ) -> None:
        self.slots = slots
        self.forget_s = forget_s
        self.max_runs = max_runs
        self.max_leases = max_leases
        self.clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, RunRecord] = {}
        self._books = Books()  # leases and marks of released ranks, counted
        self._closed = threading.Event()  # the server stops: streams end, nothing is decided
        self._due = DueChecks(self.check)  # lapse checks at the end of a stream's grace

    # -- the RPC ---------------------------------------------------------------------------
    def renew(self, req: pb.LeaseRequest, owner: str | None = None) -> pb.LeaseReply:
        """Renews (or releases) rank ``req.rank``'s lease on run ``req.run``; posts an abort
        when asked; returns the run's notice for the rank's epoch, if any. ``owner``: the
        caller (its token), whose share a run it makes counts against."""
        checks.check_request(req)
        with self._lock:
            now = self.clock()
            if req.release and req.run not in self._runs:
                return pb.LeaseReply(lost_rank=-1)
            found = self._runs.get(req.run)
            checks.check_holder(found, req, now)  # releases and aborts too
            if found is not None and checks.released_before(found, req):
                return found.notice(req.epoch)  # a renewal or release, late: it holds nothing
            run = self._run_for(req, now, owner)
            took_over = not req.release and run.taken_over(req)
            if req.release:
                # superseded: a closed client's, late: it drops nothing
                if not checks.superseded(run, req):
                    if req.rank in run.leases:
                        self._books.mark_released(run, req, self.max_leases, now)
                    elif req.ends and req.rank in run.released:  # said after its release: by
                        run.ended_at[req.rank] = now  # its launcher, which saw it exit 0
                    self._drop_lease(run, req.rank, now)
            elif not run.unseen_end(req, now, UNSEEN_END_S):
                self._hold(run, req, now)
            if req.abort:
                # a rank that lost a server and recovers, or gives up (client/run_state.py,
                # give_up): its reason reads after its name ("recovers: server 2 ... lost")
                why = f"run '{req.run}': rank {req.rank} {req.abort}"
                self._abort(req.run, run, req.epoch, why, -1, req.final)
            self._check_lapses(req.run, run, now, force=bool(req.abort))
            reply = run.notice(req.epoch)
            reply.took_over = took_over
            self._forget_if_idle(req.run, run, now)
            return reply

    # -- streams (server/collectives/lease_holds.py) ---------------------------------------
    def open_hold(
        self, req: pb.LeaseRequest, stream: Listener, owner: str | None = None
    ) -> pb.LeaseReply:
        """Holds rank ``req.rank``'s lease through ``stream`` while it is open (a renewal
        too); its first reply: the run's notice for the rank's epoch, if any."""
        checks.check_request(req)
        if req.release or req.abort:
            raise ShardError.invalid("HoldLease: release and abort go in a Lease call")
        with self._lock:
            if self._closed.is_set():
                raise ShardError.precondition("HoldLease: this server is stopping")
            found, now = self._runs.get(req.run), self.clock()
            checks.check_holder(found, req, now)
            if checks.released_before(found, req):
                raise ShardError.precondition("HoldLease: this client released the rank's lease")
            run = self._run_for(req, now, owner)
            took_over = run.taken_over(req)
            self._hold(run, req, now)
            run.leases[req.rank].held_by.add(stream)
            run.leases[req.rank].reheard = False
            run.streams.add(stream)
            reply = run.notice(req.epoch)
            reply.took_over = took_over
            return reply

    def end_hold(self, stream: Listener) -> bool:
        """``stream`` ended; whether its rank now has ``STREAM_GRACE_S`` to come back (its
        last stream, not released), after which the caller calls ``check_later``."""
        with self._lock:
            run = self._runs.get(stream.run)
            if run is None or stream not in run.streams:
                return False
            run.streams.discard(stream)
            lease = run.leases.get(stream.rank)
            if lease is None or stream not in lease.held_by or self._closed.is_set():
                return False  # released (or the server stops): nothing to decide
            lease.held_by.discard(stream)
            if lease.held_by:
                return False
            now = self.clock()
            lease.closed_at, lease.expires = now, now + STREAM_GRACE_S
            run.moved()
            return True

    def check(self, run: str) -> None:
        """Looks for lapses in run ``run`` now."""
        with self._lock:
            found = self._runs.get(run)
            if found is not None and not self._closed.is_set():
                self._check_lapses(run, found, self.clock(), force=True)

    def check_later(self, run: str) -> None:
        """Looks for lapses in run ``run`` once ``STREAM_GRACE_S`` has passed (``end_hold``
        said its rank has that long to come back), from one thread for every run."""
        self._due.at(run, STREAM_GRACE_S)

    def close(self) -> None:
        """The server stops: every stream ends (its rank's client reconnects elsewhere or
        sees the server gone), and nothing more is decided."""
        with self._lock:
            self._closed.set()
            streams = [x for run in self._runs.values() for x in run.streams]
        for stream in streams:
            stream.stop()
        self._due.stop()

    def sweep(self) -> None:
        """Finds lapses of runs no live rank renews any more, and forgets idle runs (the
        server's sweeper calls it)."""
        with self._lock:
            if self._closed.is_set():
                return
            now = self.clock()
            for name, run in list(self._runs.items()):
                self._check_lapses(name, run, now, force=True)
                self._forget_if_idle(name, run, now)

    def live_ranks(self, run: str) -> frozenset[int] | None:
        """The ranks of run ``run`` whose lease here has not lapsed; None when this server
        knows no lease of the run (elastic membership reads it,
        server/collectives/membership.py). The same set object while it holds
        (``RunRecord.live_set``)."""
        with self._lock:
            held = self._runs.get(run)
            return None if held is None else held.live_set(self.clock())

    def whereabouts(self, run: str, ranks: Sequence[int]) -> str:
        """``RankNews.whereabouts`` (server/runtime/run_names.py), asked by waits that hold a
        slot's or a slice's lock, which an abort takes under this table's lock: so not under
        it."""
        return lease_words.whereabouts(self._runs, run, ranks, self.clock())

    def ended(self, run: str, ranks: Sequence[int]) -> str:
        """``RankNews.ended``: "" unless every rank of ``ranks`` ended for good
        (``lease_words.ended``); not under the lock, as ``whereabouts``."""
        return lease_words.ended(self._runs, run, ranks, self.clock())

    def drop(self, run: str) -> bool:
        """Forgets run ``run`` and its leases (``DropJob`` of the run); whether it was held.
        Its open streams end: their ranks open them again, held by the run's new record
        (before, a stream stayed with the forgotten record: its rank's death was found only
        by a renewal's lapse, 30 s, and another process could take its rank meanwhile)."""
        with self._lock:
            gone = self._runs.pop(run, None)
            if gone is None:
                return False
            self._books.forget(gone)
            streams = list(gone.streams)
        for stream in streams:
            stream.stop()
        return True

    # -- bookkeeping (caller holds the lock) ------------------------------------------------
    def _run_for(self, req: pb.LeaseRequest, now: float, owner: str | None) -> RunRecord:
        run = self._runs.get(req.run)
        if run is not None and run.final and checks.restart_of(run, req):
            return run  # its final notice answers the restart (LeaseRequest.restarted)
        if run is not None and checks.abandoned(run, req, now):  # its ranks were all killed
            checks.check_settled(run, req, now)  # refused while one was heard lately
            self._forget(req.run, run)
            run = None
        elif run is not None and not run.any_live(now, but=req.rank):
            mine = run.leases.get(req.rank)
            survivor = mine is not None and mine.live(now)  # keeps renewing after an abort
            ended = (
                not run.leases and not req.release and checks.ended_run(req.run, run, self.slots)
            )
            if (
                run.world_size != req.world_size
                or (run.aborted_epoch >= 0 and not survivor and req.fresh)
                or ended  # its ranks released their leases: the run ended
            ):
                self._forget(req.run, run)  # a new run under the same id
                run = None
        if run is None:
            self._books.room_for_run(self._runs.values(), owner, req, self.max_runs)
            if not req.release:  # refused before the run is added: no empty run stays
                self._books.room(owner, req, self.max_leases)
            run = self._runs[req.run] = RunRecord(req.world_size, owner)
        elif run.world_size != req.world_size:
            raise ShardError.precondition(
                f"Lease: run '{req.run}' has world size {run.world_size} here (ranks"
                f" {_listed(run.live(now))} hold leases), rank {req.rank} renews with world"
                f" size {req.world_size}: two runs share the id"
            )
        return run

    def _hold(self, run: RunRecord, req: pb.LeaseRequest, now: float) -> None:
        lease = run.leases.get(req.rank)
        if lease is None:
            self._books.room(run.owner, req, self.max_leases)
            self._books.leases.add(run.owner)
        ttl, rejoin = req.ttl_ms / 1000, req.rejoin_ms / 1000
        # renewed after its stream ended: alive (``check_holder``; a new stream clears it)
        reheard = lease is not None and (lease.closed_at is not None or lease.reheard)
        if lease is None or lease.lapsed_at is not None:  # new, or back from a lapse
            held = lease.held_by if lease is not None else set()
            lease = LeaseRecord(now + ttl, req.epoch, ttl, rejoin, now, now, held_by=held)
            run.put(req.rank, lease)
        else:
            back = not lease.live(now)
            if back:
                lease.since = now
            if back or now + ttl < lease.expires:
                run.moved()  # back, or shorter than it was: the live set may change
            # a renewal of an earlier epoch handled late (a busy server) keeps the newer one
            lease.expires, lease.epoch, lease.ttl_s, lease.rejoin_s = (
                now + ttl,
                max(lease.epoch, req.epoch),
                ttl,
                rejoin,
            )
            lease.heard, lease.closed_at = now, None
            run.recent = req.rank
        lease.reheard = reheard
        if req.holder:
            lease.holder, lease.client = req.holder, req.client
        if req.launch:  # one entry a rank: bounded as the run's ranks are
            run.launches[req.rank] = req.launch
        run.idle_since = None

    def _drop_lease(self, run: RunRecord, rank: int, now: float) -> None:
        if run.pop(rank) is not None:
            self._books.leases.remove(run.owner)
        if not run.leases:
            run.idle_since = now

    def _check_lapses(self, name: str, run: RunRecord, now: float, force: bool = False) -> None:
        if not force and now - run.checked < CHECK_EVERY_S:
            return
        run.checked = now
        silent = [(rank, lease) for rank, lease in run.leases.items() if not lease.live(now)]
        if not silent:
            return
        witnesses = None  # built once, if a lease is past its wait for a restart
        epoch = max(x.epoch for x in run.leases.values())
        for rank, lease in silent:
            run.lapse(rank, lease)
            if now - lease.lapsed_at < lease.rejoin_s:
                continue  # the run waits for a restart of this rank
            if witnesses is None:
                witnesses = Witnesses(run, now, ISOLATED_GRACE_S)
            if not witnesses.saw(lease):
                if now - lease.expires > self.forget_s:  # the whole run went quiet long ago
                    self._drop_lease(run, rank, now)
                continue  # this server may be the one cut off: it decides nothing
            self._drop_lease(run, rank, now)
            run.lost = {r: t for r, t in run.lost.items() if now - t < UNSEEN_END_S}
            run.lost[rank] = now
            why = f"run '{name}' aborted: rank {rank} lost ({lease.lost_why()})"
            self._abort(name, run, epoch, why, rank)

    def _abort(
        self, name: str, run: RunRecord, epoch: int, why: str, lost: int, final: bool = False
    ) -> None:
        if run.final or (epoch <= run.aborted_epoch and not final):
            return  # that epoch ended already (or the run did): its first reason stands
        run.aborted_epoch, run.reason, run.lost_rank = max(epoch, run.aborted_epoch), why, lost
        run.final = final
        self.slots.abort_run(name, run.aborted_epoch, why)
        notice = run.notice(run.aborted_epoch)
        for stream in run.streams:  # every rank learns now, not at its next renewal
            stream.push(notice)

    def _forget_if_idle(self, name: str, run: RunRecord, now: float) -> None:
        if not run.leases and run.idle_since is not None and now - run.idle_since > self.forget_s:
            self._forget(name, run)

    def _forget(self, name: str, run: RunRecord) -> None:
        self._books.forget(run)
        del self._runs[name]
        self.slots.forget_run(name)


def _listed(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
