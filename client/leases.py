"""A rank's lease on the servers: the other ranks learn within seconds that it died, and
never take it for dead while it is only slow.

Every client of a multi-rank run holds a lease on each of its servers
(server/collectives/leases.py) in two ways, the same under ``paramshard launch``, torchrun,
``LocalCluster`` threads or a script of your own:

- an open ``HoldLease`` stream per server (client/lease_holds.py). The connection holds the
  lease without any help from this process's Python code: a rank that is stopped (SIGSTOP,
  swapped out), paused by a long garbage collection or holding the GIL in a long call keeps its
  lease however long that lasts, since its kernel keeps the connection; a rank whose process
  dies is taken for lost about ``STREAM_GRACE_S`` (1 s) after its kernel closed the connection;
  a host that vanishes, after the servers' TCP user timeout (30 s, server/app.py). The stream
  also brings the run's notices the moment a server raises them.
- renewals (``Lease``) every ``RENEW_S`` by one thread per process (client/lease_keeper.py;
  less often in runs of more than ``RENEWALS_A_SECOND`` ranks), which carry the rank's epoch
  and bring notices back. One may wait in a busy server as long as the rank's pace there, and
  no second one goes to that server meanwhile (client/lease_renewals.py). Where a server
  refuses the stream (an older server, one at its ``--max-sessions`` bound), the lease lives
  on renewals alone and lapses ``PARAMSHARD_LEASE_TTL_S`` (30 s: why, in
  docs/inspection-and-recovery.md) after the last one: the renewing thread needs the GIL
  then.

When a server says the run's epoch was aborted (a rank was lost, or a rank gave up the epoch
after losing a server: ``RunState.give_up``), the client *cancels its calls in flight* and
refuses new calls that would wait for other ranks, with ABORTED and the notice ("run 'R'
aborted: rank 3 lost ..."), until it moves to a newer epoch (``restart_collectives``, which
``train_with_recovery`` calls). A notice that names a lost rank cannot be recovered from by the
others (the rank's process is gone); one that names a lost server can.

Under ``train_with_recovery`` (``RunState.fail_fast``), a server whose stream ended and whose
renewals fail for ``STREAM_GRACE_S`` (its process died), or that fails every renewal for a TTL
(it vanished), is taken for lost: the client gives up its epoch on the other servers, and every
rank recovers at once. So is a server that answers a renewal as another process than it did
earlier in the epoch (``LeaseReply.incarnation``): it restarted, empty, within the grace, while
this rank may be waiting on another server's call (a node down). Otherwise the calls' retries
decide how long a server is waited for.

A rank that ``paramshard launch --max-restarts`` may restart carries ``rejoin_ms``
(``PARAMSHARD_REJOIN_TIMEOUT_S``, default 120 s when restarts are on): the servers wait that
long for its restart instead of aborting (DDP and 3D models, whose state is in the trainer: 0).

Every request names this process and client (``holder_id``, ``next_client``: a closed client's
late requests change nothing on the servers); a server where another process holds the rank
through an open stream refuses it (ALREADY_EXISTS: two jobs share the run id). A new client
waits for its streams' first answers and asks again for ``TAKEOVER_S``, then raises
``LeaseConflict``; one refused later fails every call that waits for other ranks.

``close()`` on the client (and, as a safety net, the interpreter's exit: protos/closing.py)
releases its lease, then ends its streams and the threads that read them: a rank that ends
normally aborts nothing. The exit's release says when the rank ends for good (``ends``), so a
peer's wait for it fails at once. The renewing thread ends with the process's last lease.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from typing import Any

import grpc

from paramshard.client import lease_holds, lease_releases, restarts
from paramshard.client.env import env_seconds
from paramshard.client.lease_holds import CONFLICT, REFUSALS, HoldStream, LeaseConflict
from paramshard.client.lease_keeper import RENEW_S, Keeper
from paramshard.client.lease_renewals import Renewals
from paramshard.client.restarts import ends_for_good, max_restarts
from paramshard.client.run_state import FINAL, Notice, RunState
from paramshard.protos import closing
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.run_ids import MAX_EPOCH
from paramshard.protos.words import said

__all__ = ["LEASE_TTL_ENV", "REJOIN_ENV", "hold", "release"]

log = logging.getLogger("paramshard.leases")

LEASE_TTL_ENV = "PARAMSHARD_LEASE_TTL_S"
REJOIN_ENV = "PARAMSHARD_REJOIN_TIMEOUT_S"
DEFAULT_TTL_S = 30.0
DEFAULT_REJOIN_S = 120.0
HOLD_RETRY_S = 30.0  # a server that refused a stream is asked again after this long
FIRST_ANSWER_S = 2.0  # how long a new client waits for its streams' first answers, at most
TAKEOVER_S = 12.0
"""For this long after a client is made, a server that says another process holds its rank
(``CONFLICT``) is asked again: that process may have just died, its streams' end not yet seen
there (a restart), or its whole job did (a server waits ``SETTLE_S``, 8 s, for such a job's
ranks: server/collectives/lease_records.py). Then the rank is refused (``RunState.refuse``)."""


class _Holding(Renewals):
    """One rank's lease on its client's servers: a stream and renewals per server."""

    def __init__(self, client: Any, ttl_s: float, rejoin_s: float) -> None:
        self.client = weakref.ref(client)
        self.spec = client.spec  # for a notice after the client closed (``_end_closed``)
        self.state: RunState = client.run_state
        self.run = client.__dict__.get("_base_run_id", client.run_id)
        self.rank, self.world_size = client.rank, client.world_size
        self.ttl_s, self.rejoin_s = ttl_s, rejoin_s
        self.failing_since: dict[int, tuple[float, int]] = {}  # server -> (since, epoch)
        self.silenced: set[int] = set()  # servers that refuse leases for good
        self.full: set[int] = set()  # servers at their bound of leases: asked at each renewal
        self.holds: dict[int, HoldStream] = {}  # server -> its stream
        self.refused_until: dict[int, float] = {}  # server -> when to ask for a stream again
        self.stream_lost: set[int] = set()  # servers whose stream broke and is not back
        self.answered: dict[int, tuple[float, int]] = {}  # server -> (sent at, epoch): answered
        self.incarnations: dict[int, tuple[int, int]] = {}  # server -> (its process, epoch)
        # server -> the renewal in flight there: (future, (sent at, epoch), when to drop it)
        self._in_flight: dict[int, tuple[Any, tuple[float, int], float]] = {}
        self._lock = threading.Lock()
        self.released = False
        self.conflict: str | None = None  # another process holds this rank: why, as told
        self.made = False  # the client's construction is over (hold returned)
        self.takeover_until = time.monotonic() + TAKEOVER_S
        self.number = lease_holds.next_client()  # LeaseRequest.client
        self.restarted = restarts.restart_count() > 0  # LeaseRequest.restarted
        self.closed_on_error = False  # its client closed while an exception was handled

    def _request(self, **kw: Any) -> pb.LeaseRequest:
        return pb.LeaseRequest(
            run=self.run,
            rank=self.rank,
            world_size=self.world_size,
            epoch=self.state.epoch,
            ttl_ms=int(self.ttl_s * 1000),
            rejoin_ms=int(self.rejoin_s * 1000),
            holder=lease_holds.holder_id(),
            client=self.number,
            fresh=not self.made,
            restarted=self.restarted,
            launch=restarts.launch_id(),
            **kw,
        )

    # -- streams -------------------------------------------------------------------------
    def keep_holds(self) -> None:
        """Opens a stream to every server that has none (a broken one at once, a refused one
        after ``HOLD_RETRY_S``)."""
        client = self.client()
        if client is None or client.closed:
            return
        now = time.monotonic()
        conflict = None
        with self._lock:
            if self.released:
                return
            wanted = []
            for i in range(client.num_servers):
                old = self.holds.get(i)
                if i in self.silenced or (old is not None and old.open):
                    continue
                if old is not None and old.ended is not None:
                    code, details = old.ended
                    if code == CONFLICT and now >= self.takeover_until:
                        conflict = (i, details)
                    elif code in REFUSALS:
                        self.refused_until[i] = old.ended_at + HOLD_RETRY_S
                        log.debug("server %d: no lease stream (%s: %s)", i, code.name, details)
                    else:
                        self.stream_lost.add(i)
                    del self.holds[i]
                if now >= self.refused_until.get(i, 0.0):
                    wanted.append(i)
        if conflict is not None:
            self.refuse(*conflict)
            return
        # gRPC is called with no lock of ours held: a thread stuck in gRPC (see release)
        # must not hold up the thread that closes
        for i in wanted:
            try:
                hold = HoldStream(
                    client.spec.channel(i),
                    self._request(),
                    client.spec.metadata(),
                    lambda reply, i=i: self._on_reply(i, reply),
                    f"lease-stream-{i}",
                )
            except ValueError:  # the channel was closed under us
                return
            with self._lock:
                if self.released:  # released meanwhile: this one goes too
                    stray = hold
                else:
                    stray, self.holds[i] = self.holds.get(i), hold
            if stray is not None:
                stray.close()

    def await_holds(self) -> None:
        """Waits for every stream's first answer (a silent server ``FIRST_ANSWER_S`` at most),
        asking a server that says another process holds this rank again until
        ``takeover_until``: such a rank is refused before its first collective."""
        first_by, last = time.monotonic() + FIRST_ANSWER_S, self.takeover_until + FIRST_ANSWER_S
        conflicted = False  # a server said so: its stream, asked again, is waited for
        while self.conflict is None and not self.released and time.monotonic() < last:
            with self._lock:
                holds = list(self.holds.values())
            now = time.monotonic()
            waiting = [x for x in holds if not x.answered.is_set()]
            if any(x.ended is not None and x.ended[0] == CONFLICT for x in holds):
                conflicted = True
                time.sleep(0.25 if now < self.takeover_until else 0.0)
                self.keep_holds()  # asks again; refuses the rank once takeover_until passed
            elif waiting and (now < first_by or conflicted):
                waiting[0].answered.wait(0.25)
            else:
                return

    def refuse(self, server: int, details: str) -> None:
        """Server ``server`` says another process holds this rank: the rank releases its lease
        (refused where the other holds it) and fails every call that waits for other ranks."""
        client = self.client()
        address = client.spec.addresses[server] if client is not None else "?"
        with self._lock:
            if self.conflict is not None:
                return
            self.conflict = f"server {server} ({address}): {details}"
            made = self.made  # else the client's construction raises it: said once
        self.state.refuse(self.conflict, say=made)
        self.release()

    def _on_reply(self, server: int, reply: pb.LeaseReply) -> None:
        self.stream_lost.discard(server)  # the stream is (back) up
        self.take_reply(reply)

    def take_reply(self, reply: pb.LeaseReply) -> None:
        """A server's answer: its abort notice, if any, and whether this process holds the
        rank in place of an earlier one (``RunState.took_over``)."""
        if reply.took_over:
            self.state.took_over = True
        if reply.aborted and (reply.final or reply.aborted_epoch <= MAX_EPOCH):  # else a lie
            self.take_notice(reply)

    def take_notice(self, reply: pb.LeaseReply) -> None:
        """The abort notice of a server's answer. One that names this rank lost, come before
        this client was made, is about this rank's previous process, which this one replaces
        (a restart): logged as that, at info, not as news of a loss."""
        words = said(reply.aborted)  # the server's: printable and bounded (protos/words.py)
        epoch = FINAL if reply.final else reply.aborted_epoch  # final: at every epoch
        notice = Notice(words, epoch, reply.lost_rank, final=reply.final)
        inherited = not self.made and reply.lost_rank == self.rank
        if self.state.abort(notice, say=not inherited) and inherited:
            log.info("%s: that was this rank's previous process; this one takes its place", words)

    def close_holds(self) -> None:
        with self._lock:
            holds, self.holds = list(self.holds.values()), {}
        for hold in holds:
            hold.close()

    # -- ends ----------------------------------------------------------------------------
    def post_abort(self, cause: str, final: bool = False) -> str | None:
        """Asks every server to abort this rank's epoch for ``cause`` (``final``: the run's,
        at every epoch); the notice as the servers word it (None: no server answered, or the
        client closed: then the notice goes in a release, as a launcher sends it)."""
        if self.released:
            failed = self._post_closed(self._request(release=True, abort=cause[:1024], final=final))
            if failed:
                log.warning("rank %d: %s; not posted on %s", self.rank, cause, "; ".join(failed))
            return None
        worded = None
        deadline = time.monotonic() + 2 * RENEW_S  # the calls' deadline is at most RENEW_S
        for _, fut in self.start(self._request(abort=cause[:1024], final=final)):
            try:
                reply = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except (grpc.RpcError, grpc.FutureTimeoutError):
                continue
            if worded is None and reply.aborted and reply.aborted_epoch == self.state.epoch:
                worded = reply.aborted
        return worded

    def _stop_others_at_exit(self) -> None:
        """At the exit of a process that raised, where no ``train_with_recovery`` caught it
        (before training, or in a loop of the script's own), what that loop does for its own
        errors (strategies/recovery_rounds.py ``stop_the_others``): a rank nothing restarts
        posts the run's final notice, so the others stop now; before, they waited out their
        deadline, took it for a lost server and recovered, again and again (a field check). A
        rank its launcher may restart tells the launcher its error. Nothing when the rank said
        why it stops already, when a notice ended its epoch (the others know, or it failed on
        theirs), or for an elastic rank (it left the job)."""
        error, state = closing.uncaught(), self.state
        if error is None or restarts.declared_stop() or state.elastic:
            return
        if state.ended_run or state.current() is not None:
            return
        why = restarts.one_line(error)
        state.stop_on_error(why, f"stopped on an error no recovery mends ({why})")

    def _say_at_exit(self) -> None:
        """A ``close()`` before the exit (a ``finally``, an ``except`` that cleans up) releases
        the lease before the exit could say how the rank ends (the others then waited out their
        deadline). So the exit says it (``_end_closed``) as its own release would have: the
        final notice if the close came on an error and an error then went uncaught; else, with
        nothing to start the rank again, that it ended. A later client of the rank drops it."""
        if not self.made or closing.exiting():
            return
        self.closed_on_error = sys.exc_info()[1] is not None
        _keep_for_exit((self.run, self.rank), self)

    def _end_closed(self) -> None:
        """At the exit, for a lease its client released before: what its release would say."""
        if closing.uncaught() is not None:
            if self.closed_on_error:
                self._stop_others_at_exit()
        elif ends_for_good() and not restarts.launched():  # a launcher says it, by exit code
            request = self._request(release=True, ends=True)
            request.client = 0  # an older server drops a released client's own as late
            self._post_closed(request)

    def _post_closed(self, request: pb.LeaseRequest) -> list[str]:
        """Sends release ``request`` after the client closed, on channels of its own; what
        failed (``lease_releases.post``). At the exit, all such releases share one bound,
        ``2 * RENEW_S``: a process that closed many clients whose servers are gone exits."""
        global _exit_posts_until
        now = time.monotonic()
        if closing.exiting():
            _exit_posts_until = _exit_posts_until or now + 2 * RENEW_S
            bound = _exit_posts_until - now
            if bound <= 0:
                return ["no time left at the exit"]
        else:
            bound = 2 * RENEW_S
        spec = self.spec.detached()
        try:
            return lease_releases.post(spec, request, bound)
        finally:
            spec.close()

    def release(self) -> None:
        """The rank ends normally: the lease goes first (so the streams' end aborts nothing),
        then the streams and their threads."""
        with self._lock:
            released, self.released = self.released, True
            flying, self._in_flight = self._in_flight, {}
        for fut, _, _ in flying.values():  # a late one would change nothing there
            fut.cancel()
        if not released:
            self._stop_others_at_exit()
            self._say_at_exit()
            request, sent = self._request(release=True, ends=ends_for_good()), []
            # bounded as a close's steps are: a lock left taken in a channel would hold it
            closing.bounded(lambda: sent.extend(self.start(request)), "sending a lease release")
            lease_releases.await_release(self.client(), request, list(sent))
        self.close_holds()


keeper = Keeper()
_lock = threading.Lock()
_closed: dict[tuple[str, int], _Holding] = {}  # (run, rank) -> its ``_say_at_exit``
_exit_posts_until: float | None = None  # ``_post_closed``'s bound at the exit


def _keep_for_exit(key: tuple[str, int], holding: _Holding | None) -> None:
    """What the exit says for rank ``key`` (run, rank): ``holding``'s (``_say_at_exit``), or
    nothing (None: a new client of the rank says it); ``KEPT`` ranks at most, oldest out first."""
    with _lock:
        dropped = [_closed.pop(key, None)]
        if holding is not None:
            _closed[key] = holding  # closing holds it weakly
        while len(_closed) > lease_releases.KEPT:
            dropped.append(_closed.pop(next(iter(_closed))))
    for earlier in filter(None, dropped):
        closing.forget(earlier)
    if holding is not None:
        closing.close_at_exit(holding, _Holding._end_closed)


def hold(client: Any) -> None:
    """Starts ``client``'s lease (a rank of a run of more than one rank): its streams now,
    its renewals on the process's renewing thread."""
    ttl = env_seconds(LEASE_TTL_ENV, DEFAULT_TTL_S, 0.5, 600.0)
    rejoin = env_seconds(REJOIN_ENV, DEFAULT_REJOIN_S, 0.0, 3600.0) if max_restarts() else 0.0
    holding = _Holding(client, ttl, rejoin)
    _keep_for_exit((holding.run, holding.rank), None)  # this process goes on with the rank
    lease_releases.send_again(client, holding.run)  # earlier clients' releases, if late
    holding.takeover_until = time.monotonic() + TAKEOVER_S
    client.run_state.holding = holding
    holding.keep_holds()
    holding.await_holds()
    with holding._lock:
        holding.made = holding.conflict is None
    if not holding.made:
        raise LeaseConflict(holding.conflict)
    if any(x is None or not x.open for x in map(holding.holds.get, range(client.num_servers))):
        holding.renew()  # a server without a stream knows the lease before the first collective
    keeper.add(holding)


def release(client: Any) -> None:
    """Releases ``client``'s lease if it holds one (its ``close()``)."""
    holding = client.run_state.holding
    if holding is not None and holding.client() is client:
        holding.release()
        keeper.discard(holding)
