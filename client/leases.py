"""A rank's lease on the servers: the other ranks learn in about two seconds that it is gone.

Every client of a multi-rank run holds a lease on each of its servers
(server/collectives/leases.py), renewed every ``RENEW_S`` by one thread per process, so it works the
same under ``paramshard launch``, torchrun, ``LocalCluster`` threads or a script of your own. A
lease lapses ``PARAMSHARD_LEASE_TTL_S`` (default 2 s) after its last renewal; raise it for scripts
that hold Python's GIL longer than that (the renewing thread needs it).

When a server says the run's epoch was aborted (a rank's lease lapsed, or a rank gave up the
epoch after losing a server: ``RunState.give_up``), the client *cancels its calls in flight*
and refuses new calls that would wait for other ranks, with ABORTED and the notice ("run 'R'
aborted: rank 3 lost ..."), until it moves to a newer epoch (``restart_collectives``, which
``train_with_recovery`` calls). A notice that names a lost rank cannot be recovered from by
the others (the rank's process is gone); one that names a lost server can.

Under ``train_with_recovery`` (``RunState.fail_fast``), a server that fails every renewal
for a TTL is taken for lost: the client gives up its epoch on the other servers, and every
rank starts recovering at once. Otherwise an unreachable server is waited for as the calls'
retries allow: a link cut shorter than that ends nothing.

A rank that ``paramshard launch --max-restarts`` may restart carries ``rejoin_ms``
(``PARAMSHARD_REJOIN_TIMEOUT_S``, default 120 s when restarts are on): the servers then wait
that long for its restart instead of aborting. Models that keep their state in the trainer
(DDP, 3D) cannot rejoin and set it to 0 when built.

``close()`` on the client, and the interpreter's exit, release its lease: a rank that ends
normally aborts nothing.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import grpc

from paramshard.client.restarts import max_restarts
from paramshard.protos import shard_pb2 as pb

__all__ = ["Notice", "RunState", "LEASE_TTL_ENV", "REJOIN_ENV", "WAITS_ON_PEERS", "hold"]

log = logging.getLogger("paramshard.leases")

RENEW_S = 0.4
LEASE_TTL_ENV = "PARAMSHARD_LEASE_TTL_S"
REJOIN_ENV = "PARAMSHARD_REJOIN_TIMEOUT_S"
DEFAULT_TTL_S = 2.0
DEFAULT_REJOIN_S = 120.0
WAITS_ON_PEERS = frozenset({"PushGrad", "PullParams", "GradNorm", "Step", "Contribute", "ReadSlot"})
"""The calls whose outcome depends on other ranks: refused once the run's epoch is aborted."""


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


@dataclass(frozen=True)
class Notice:
    """A run's epoch was aborted: why, which epoch, and the rank lost (-1: none)."""

    reason: str
    epoch: int
    lost_rank: int = -1

    @property
    def recoverable(self) -> bool:
        """Whether the surviving ranks can go on (a lost server: restore and replay), as
        opposed to a lost trainer, whose process and state are gone."""
        return self.lost_rank < 0


class RunState:
    """What a client and its views (groups, ``on_servers``) share about their run: the epoch,
    the abort notice, and the calls in flight a notice cancels."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.epoch = 0
        self.notice: Notice | None = None
        self._in_flight: set[Any] = set()
        self.holding: _Holding | None = None
        self.fail_fast = False  # give up the epoch when a server stops answering renewals

    def current(self) -> Notice | None:
        """The notice when it applies to this client's epoch, else None."""
        notice = self.notice
        return notice if notice is not None and notice.epoch >= self.epoch else None

    def advance(self, epoch: int) -> None:
        """The client moved to epoch ``epoch`` (``restart_collectives``)."""
        with self._lock:
            self.epoch = max(self.epoch, epoch)

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

    def abort(self, notice: Notice) -> None:
        """Takes ``notice`` and cancels the calls in flight, if it applies to this epoch."""
        with self._lock:
            if notice.epoch < self.epoch or self.notice == notice:
                return
            if self.notice is not None and self.notice.epoch >= notice.epoch:
                return  # that epoch ended already
            self.notice = notice
            pending = list(self._in_flight)
        log.warning("%s", notice.reason)
        for future in pending:
            future.cancel()

    def give_up(self, reason: str) -> None:
        """This rank abandons its epoch (it lost a server): the others' waits end at once."""
        notice = Notice(reason, self.epoch)
        if self.holding is not None:
            self.holding.post_abort(reason)
        self.abort(notice)

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


class _Holding:
    """One rank's lease on its client's servers."""

    def __init__(self, client: Any, ttl_s: float, rejoin_s: float) -> None:
        self.client = weakref.ref(client)
        self.state: RunState = client.run_state
        self.run = client.__dict__.get("_base_run_id", client.run_id)
        self.rank, self.world_size = client.rank, client.world_size
        self.ttl_s, self.rejoin_s = ttl_s, rejoin_s
        self.failing_since: dict[int, tuple[float, int]] = {}  # server -> (since, epoch)
        self.silenced: set[int] = set()  # servers that refuse leases for good
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

    def start(self, request: pb.LeaseRequest | None = None) -> list[tuple[int, Any]]:
        """Sends ``request`` (default: a renewal) to every server at once: (server, future)."""
        client = self.client()
        if (self.released and request is None) or client is None or client._closed:
            return []
        request = request or self._request()
        timeout = max(0.2, min(1.0, self.ttl_s / 2))
        sent = []
        for i in range(client.num_servers):
            if i in self.silenced:
                continue
            try:
                stub = client._stub(i, "Lease")
                fut = stub.future(request, timeout=timeout, metadata=client.spec.metadata())
            except ValueError:  # the channel was closed under us
                return sent
            sent.append((i, fut))
        return sent

    def finish(self, sent: list[tuple[int, Any]]) -> None:
        """Takes the replies of a renewal: notices, lost servers."""
        now = time.monotonic()
        for i, fut in sent:
            try:
                reply = fut.result()
            except grpc.RpcError as exc:
                self._failed(i, exc, now)
                continue
            self.failing_since.pop(i, None)
            if reply.aborted:
                self.state.abort(Notice(reply.aborted, reply.aborted_epoch, reply.lost_rank))

    def renew(self) -> None:
        self.finish(self.start())

    def _failed(self, server: int, exc: grpc.RpcError, now: float) -> None:
        code = exc.code()
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            # an older server, a token without the train role, a run id it refuses: no lease
            # there (the calls themselves will say what is wrong)
            log.warning("no lease on server %d: %s: %s", server, code.name, exc.details())
            self.silenced.add(server)
            return
        since, epoch = self.failing_since.setdefault(server, (now, self.state.epoch))
        if now - since < self.ttl_s or epoch != self.state.epoch or self.state.current():
            return
        if not self.state.fail_fast:
            return  # the calls' own retries decide how long this rank waits for the server
        client = self.client()
        address = client.spec.addresses[server] if client is not None else "?"
        self.state.give_up(
            f"run '{self.run}' aborted by rank {self.rank}: server {server} ({address})"
            f" unreachable for {now - since:.1f} s ({code.name})"
        )

    def post_abort(self, reason: str) -> None:
        _wait(self.start(self._request(abort=reason[:1024])))

    def release(self) -> None:
        if not self.released:
            _wait(self.start(self._request(release=True)))
            self.released = True


def _wait(sent: list[tuple[int, Any]]) -> None:
    """Waits for calls whose replies do not matter (best effort)."""
    for _, fut in sent:
        try:
            fut.result()
        except grpc.RpcError:
            pass


class _Keeper:
    """The process's one renewing thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holdings: list[_Holding] = []
        self._thread: threading.Thread | None = None
        atexit.register(self.release_all)

    def add(self, holding: _Holding) -> None:
        with self._lock:
            self._holdings.append(holding)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lease", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            began = time.monotonic()
            with self._lock:
                self._holdings = [
                    h for h in self._holdings if not h.released and h.client() is not None
                ]
                holdings = list(self._holdings)
            try:  # every renewal in flight at once: a slow server delays no other lease
                for holding, sent in [(h, h.start()) for h in holdings]:
                    holding.finish(sent)
            except Exception:  # never let the thread die: the leases would lapse
                log.exception("renewing leases failed")
            time.sleep(max(0.0, RENEW_S - (time.monotonic() - began)))

    def release_all(self) -> None:
        with self._lock:
            holdings, self._holdings = self._holdings, []
        for holding in holdings:
            try:
                holding.release()
            except Exception:
                pass  # at exit: the servers will see the lease lapse


_keeper: _Keeper | None = None
_keeper_lock = threading.Lock()


def hold(client: Any) -> None:
    """Starts ``client``'s lease (a rank of a run of more than one rank)."""
    global _keeper
    ttl = _env_seconds(LEASE_TTL_ENV, DEFAULT_TTL_S, 0.5, 600.0)
    rejoin = _env_seconds(REJOIN_ENV, DEFAULT_REJOIN_S, 0.0, 3600.0) if max_restarts() else 0.0
    holding = _Holding(client, ttl, rejoin)
    client.run_state.holding = holding
    with _keeper_lock:
        if _keeper is None:
            _keeper = _Keeper()
        _keeper.add(holding)
