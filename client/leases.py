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
- renewals (``Lease``) every ``RENEW_S`` by one thread per process (less often in runs of more
  than ``RENEWALS_A_SECOND`` ranks), which carry the rank's epoch and bring notices back. Where
  a server refuses the stream (an older server, one at its ``--max-sessions`` bound), the lease
  lives on renewals alone and lapses ``PARAMSHARD_LEASE_TTL_S`` (30 s: why, in
  docs/inspection-and-recovery.md) after the last one: the renewing thread needs the GIL then.

When a server says the run's epoch was aborted (a rank was lost, or a rank gave up the epoch
after losing a server: ``RunState.give_up``), the client *cancels its calls in flight* and
refuses new calls that would wait for other ranks, with ABORTED and the notice ("run 'R'
aborted: rank 3 lost ..."), until it moves to a newer epoch (``restart_collectives``, which
``train_with_recovery`` calls). A notice that names a lost rank cannot be recovered from by the
others (the rank's process is gone); one that names a lost server can.

Under ``train_with_recovery`` (``RunState.fail_fast``), a server whose stream ended and whose
renewals fail for ``STREAM_GRACE_S`` (a server process that died), or that fails every renewal
for a TTL (one that vanished), is taken for lost: the client gives up its epoch on the other
servers, and every rank starts recovering at once. Otherwise an unreachable server is waited
for as the calls' retries allow: a link cut shorter than that ends nothing.

A rank that ``paramshard launch --max-restarts`` may restart carries ``rejoin_ms``
(``PARAMSHARD_REJOIN_TIMEOUT_S``, default 120 s when restarts are on): the servers then wait
that long for its restart instead of aborting. Models that keep their state in the trainer
(DDP, 3D) cannot rejoin and set it to 0 when built.

``close()`` on the client (and, as a safety net, the interpreter's exit: protos/closing.py)
releases its lease, then ends its streams and the threads that read them: a rank that ends
normally aborts nothing. The renewing thread ends with the last lease of the process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

import grpc

from paramshard.client.lease_holds import REFUSALS, HoldStream
from paramshard.client.restarts import max_restarts
from paramshard.client.run_state import Notice, RunState
from paramshard.protos import closing
from paramshard.protos import shard_pb2 as pb

__all__ = ["LEASE_TTL_ENV", "REJOIN_ENV", "hold", "release", "renewal_pace"]

log = logging.getLogger("paramshard.leases")

RENEW_S = 1.0
LEASE_TTL_ENV = "PARAMSHARD_LEASE_TTL_S"
REJOIN_ENV = "PARAMSHARD_REJOIN_TIMEOUT_S"
DEFAULT_TTL_S = 30.0
DEFAULT_REJOIN_S = 120.0
STREAM_GRACE_S = 1.0
"""A server whose stream ended is taken for lost (under ``fail_fast``) once its renewals have
failed this long: the servers give a rank the same (server/collectives/leases.py)."""
HOLD_RETRY_S = 30.0  # a server that refused a stream is asked again after this long
RENEWALS_A_SECOND = 64
"""A rank of a run of more ranks renews a server every ``world_size / RENEWALS_A_SECOND`` s: a
renewal costs a server 0.3-0.45 ms of CPU (``python -m benchmarks.leases``). The server still
hears the run 64 times a second (witnesses of lapses), a stream holds the lease and brings
notices at once, and a failed renewal, a new epoch or a broken stream is renewed at once."""
PACED_MAX_S = 30.0  # the longest pace with a stream; without, a sixth of the TTL (5 may fail)


def renewal_pace(world_size: int, ttl_s: float, streamed: bool) -> float:
    """Seconds between a rank's renewals of a server where it holds a stream (or not)."""
    pace = max(RENEW_S, min(PACED_MAX_S, world_size / RENEWALS_A_SECOND))
    return pace if streamed else min(pace, ttl_s / 6)


_FAILING = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,  # a server that stops cancels the calls it runs
)


def _env_seconds(name: str, default: float, low: float, high: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise ValueError(f"environment variable {name} must be seconds in {low:g}..{high:g}")
    return value


class _Holding:
    """One rank's lease on its client's servers: a stream and renewals per server."""

    def __init__(self, client: Any, ttl_s: float, rejoin_s: float) -> None:
        self.client = weakref.ref(client)
        self.state: RunState = client.run_state
        self.run = client.__dict__.get("_base_run_id", client.run_id)
        self.rank, self.world_size = client.rank, client.world_size
        self.ttl_s, self.rejoin_s = ttl_s, rejoin_s
        self.failing_since: dict[int, tuple[float, int]] = {}  # server -> (since, epoch)
        self.silenced: set[int] = set()  # servers that refuse leases for good
        self.holds: dict[int, HoldStream] = {}  # server -> its stream
        self.refused_until: dict[int, float] = {}  # server -> when to ask for a stream again
        self.stream_lost: set[int] = set()  # servers whose stream broke and is not back
        self.answered: dict[int, tuple[float, int]] = {}  # server -> (sent at, epoch): answered
        self._sending: dict[int, tuple[float, int]] = {}  # the same, for renewals in flight
        self._lock = threading.Lock()
        self.released = False

    def _request(self, **kw: Any) -> pb.LeaseRequest:
        return pb.LeaseRequest(
            run=self.run,
            rank=self.rank,
            world_size=self.world_size,
            epoch=self.state.epoch,
            ttl_ms=int(self.ttl_s * 1000),
            rejoin_ms=int(self.rejoin_s * 1000),
            **kw,
        )

    # -- streams -------------------------------------------------------------------------
    def keep_holds(self) -> None:
        """Opens a stream to every server that has none (a broken one at once, a refused one
        after ``HOLD_RETRY_S``)."""
        client = self.client()
        if client is None or client._closed:
            return
        now = time.monotonic()
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
                    if code in REFUSALS:
                        self.refused_until[i] = old.ended_at + HOLD_RETRY_S
                        log.debug("server %d: no lease stream (%s: %s)", i, code.name, details)
                    else:
                        self.stream_lost.add(i)
                    del self.holds[i]
                if now >= self.refused_until.get(i, 0.0):
                    wanted.append(i)
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

    def _on_reply(self, server: int, reply: pb.LeaseReply) -> None:
        self.stream_lost.discard(server)  # the stream is (back) up
        if reply.aborted:
            self.state.abort(Notice(reply.aborted, reply.aborted_epoch, reply.lost_rank))

    def close_holds(self) -> None:
        with self._lock:
            holds, self.holds = list(self.holds.values()), {}
        for hold in holds:
            hold.close()

    # -- renewals ------------------------------------------------------------------------
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

    def start(
        self, request: pb.LeaseRequest | None = None, paced: bool = False
    ) -> list[tuple[int, Any]]:
        """Sends ``request`` (default: a renewal; ``paced``: to the servers that are due) to
        every server at once: (server, future)."""
        client = self.client()
        if client is None or client._closed:
            return []
        if request is None:
            requests = self.renewals(paced)
            now = time.monotonic()
            self._sending = {i: (now, req.epoch) for i, req in requests.items()}
        else:
            requests = dict.fromkeys(range(client.num_servers), request)
        timeout = max(0.2, min(1.0, self.ttl_s / 2))
        sent = []
        for i, req in requests.items():
            if i in self.silenced:
                continue
            try:
                stub = client._stub(i, "Lease")
                fut = stub.future(req, timeout=timeout, metadata=client.spec.metadata())
            except ValueError:  # the channel was closed under us
                return sent
            sent.append((i, fut))
        return sent

    def finish(self, sent: list[tuple[int, Any]]) -> None:
        """Takes the replies of a renewal: notices, lost servers."""
        now = time.monotonic()
        for i, fut in sent:
            sending = self._sending.pop(i, None)
            try:
                reply = fut.result(timeout=2 * RENEW_S)  # its deadline is at most RENEW_S
            except grpc.RpcError as exc:
                self.answered.pop(i, None)
                self._failed(i, exc, now)
                continue
            except grpc.FutureTimeoutError:  # a channel stuck in gRPC (protos/closing.py)
                self.answered.pop(i, None)
                continue
            if sending is not None:
                self.answered[i] = sending
            self.failing_since.pop(i, None)
            if reply.aborted:
                self.state.abort(Notice(reply.aborted, reply.aborted_epoch, reply.lost_rank))

    def renew(self) -> None:
        self.finish(self.start())

    def _failed(self, server: int, exc: grpc.RpcError, now: float) -> None:
        code = exc.code()
        if code not in _FAILING:
            # an older server, a token without the train role, a run id it refuses: no lease
            # there (the calls themselves will say what is wrong)
            log.warning("no lease on server %d: %s: %s", server, code.name, exc.details())
            self.silenced.add(server)
            return
        since, epoch = self.failing_since.setdefault(server, (now, self.state.epoch))
        # a server whose process died broke its stream too: it is not coming back soon
        patience = STREAM_GRACE_S if server in self.stream_lost else self.ttl_s
        if now - since < patience or epoch != self.state.epoch or self.state.current():
            return
        if not self.state.fail_fast:
            return  # the calls' own retries decide how long this rank waits for the server
        client = self.client()
        address = client.spec.addresses[server] if client is not None else "?"
        self.state.give_up(
            f"server {server} ({address}) lost: unreachable for {now - since:.1f} s ({code.name})"
        )

    def post_abort(self, cause: str) -> str | None:
        """Asks every server to abort this rank's epoch for ``cause``; the notice as the
        servers word it (None: no server answered)."""
        worded = None
        deadline = time.monotonic() + 2 * RENEW_S  # the calls' deadline is at most RENEW_S
        for _, fut in self.start(self._request(abort=cause[:1024])):
            try:
                reply = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except (grpc.RpcError, grpc.FutureTimeoutError):
                continue
            if worded is None and reply.aborted and reply.aborted_epoch == self.state.epoch:
                worded = reply.aborted
        return worded

    def release(self) -> None:
        """The rank ends normally: the lease goes first (so the streams' end aborts nothing),
        then the streams and their threads."""
        with self._lock:
            released, self.released = self.released, True
        if not released:
            _wait(self.start(self._request(release=True)))
        self.close_holds()


def _wait(sent: list[tuple[int, Any]], bound_s: float = closing.STEP_S) -> None:
    """Waits, at most ``bound_s`` in all, for calls whose replies do not matter."""
    deadline = time.monotonic() + bound_s
    for _, fut in sent:
        try:
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
            pass


class _Keeper:
    """The process's one renewing thread, running while any lease is held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holdings: list[_Holding] = []
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def add(self, holding: _Holding) -> None:
        with self._lock:
            self._holdings.append(holding)
            if self._thread is None:
                self._wake.clear()
                self._thread = threading.Thread(target=self._run, name="lease", daemon=True)
                self._thread.start()

    def discard(self, holding: _Holding) -> None:
        """``holding`` was released: the thread ends (and is waited for) with the last one."""
        with self._lock:
            if holding in self._holdings:
                self._holdings.remove(holding)
            thread = self._thread if not self._holdings else None
        if thread is not None and thread is not threading.current_thread():
            self._wake.set()
            thread.join(closing.STEP_S)  # it ends after its renewals in flight (1 s deadline)

    def _run(self) -> None:
        while True:
            began = time.monotonic()
            with self._lock:
                self._wake.clear()
                live = [h for h in self._holdings if not h.released and h.client() is not None]
                # a client dropped without close(): its streams end here (a released one's
                # end in its release, on the thread that closes)
                dropped = [h for h in self._holdings if not h.released and h.client() is None]
                self._holdings = live
                if not live:
                    self._thread = None
            for holding in dropped:
                holding.close_holds()
            if not live:
                return
            try:  # every renewal in flight at once: a slow server delays no other lease
                for holding in live:
                    holding.keep_holds()
                for holding, sent in [(h, h.start(paced=True)) for h in live]:
                    holding.finish(sent)
            except Exception:  # never let the thread die: the leases would lapse
                log.exception("renewing leases failed")
            self._wake.wait(max(0.0, RENEW_S - (time.monotonic() - began)))


_keeper = _Keeper()


def hold(client: Any) -> None:
    """Starts ``client``'s lease (a rank of a run of more than one rank): its streams now,
    its renewals on the process's renewing thread."""
    ttl = _env_seconds(LEASE_TTL_ENV, DEFAULT_TTL_S, 0.5, 600.0)
    rejoin = _env_seconds(REJOIN_ENV, DEFAULT_REJOIN_S, 0.0, 3600.0) if max_restarts() else 0.0
    holding = _Holding(client, ttl, rejoin)
    client.run_state.holding = holding
    holding.keep_holds()
    _keeper.add(holding)


def release(client: Any) -> None:
    """Releases ``client``'s lease if it holds one (its ``close()``)."""
    holding = client.run_state.holding
    if holding is not None and holding.client() is client:
        holding.release()
        _keeper.discard(holding)
