"""``ShardServer``: one shard server, in-process (tests, notebooks) or as ``paramshard serve``."""

from __future__ import annotations

import dataclasses
import math
import threading
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from paramshard.protos import closing, local_servers
from paramshard.server.config import ServerConfig
from paramshard.server.rpc import auth, tls, tokens
from paramshard.server.rpc.admission import CallGate
from paramshard.server.runtime import backend
from paramshard.server.runtime.expiry import Sweeper, sweep_period
from paramshard.server.runtime.limits import default_memory_limit, parse_bytes
from paramshard.server.runtime.thread_names import name_this_thread
from paramshard.server.servicer import SERVICE_NAME, ShardServicer
from paramshard.server.transport.sessions import Sessions

__all__ = ["ShardServer", "MALLOC_ENV", "PING_TIMEOUT_MS", "TCP_USER_TIMEOUT_S"]

TCP_USER_TIMEOUT_S = 30.0
"""How long data this server sent may stay unacknowledged before the kernel closes the
connection (gRPC sets TCP_USER_TIMEOUT from its keepalive timeout, default 20 s: gRPC proposal
A18). A trainer's lease stream sends a heartbeat every few seconds, so this is how long a host
that vanished holds its ranks' leases (server/collectives/lease_holds.py). A stopped or busy
process is not affected: its kernel acknowledges. (Why 30 s, against torchelastic's 15 s and
torchft's 5 s: docs/inspection-and-recovery.md.) gRPC's keepalive pings (every two hours while
a call is open) share this timeout: a process stopped for longer than that when a ping comes
is taken for dead."""
PING_TIMEOUT_MS = 2**31 - 1
"""How long an HTTP/2 ping this server sent may go unanswered before gRPC closes the connection
(``grpc.http2.ping_timeout_ms``; the keepalive probe's own timeout is the one above). gRPC's
default is a minute, and its core pings a connection that carries data to size its flow-control
window: a rank stopped (SIGSTOP, a debugger, swapped out) in the middle of a call answers none,
so a field test's rank stopped 150 s mid-step was taken for lost 61 s into the stop, its lease
stream closed with the connection (tests/test_field_faults.py). A silent host is found by
TCP_USER_TIMEOUT_S; a stopped process must not be, so the bound is gRPC's largest (24.8 days)."""
GRPC_UNTAKEN_S = 30
"""How long gRPC's core keeps a call that came while this server's Python loop could not take
it up (``grpc.server_max_unrequested_time_in_server``) before it ends it CANCELLED, "CANCELLED",
its handler never run. The loop takes one call at a time and needs the GIL: with gRPC's
default, a process whose Python threads stalled for longer (a thread holding the GIL:
tests/test_server_stall.py) lost every call past the first that came meanwhile, and a CI run
on a machine full of CPU hogs lost a rank's RegisterBuffer so. The server keeps such calls as
long as any call may wait (``max_wait_s``), never less than this, gRPC's own default; each
call's deadline still ends it."""
STOP_MARGIN_S = 5.0
"""Past its grace, how long ``stop`` waits for gRPC to wind down before it goes on anyway."""

# docs/design.md §7.5: glibc mmaps (and page-faults) every buffer >= 32 MiB afresh; these settings
# took a 256 MiB call from 0.35 to 0.96 GB/s. They only work if set before the interpreter starts.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "1073741824",
    "MALLOC_TRIM_THRESHOLD_": "4294967296",
    "MALLOC_ARENA_MAX": "1",
}


class ShardServer:
    """A shard server bound to ``host:port`` (port 0 picks a free one; see ``.address``).

    Binds 127.0.0.1 by default: a server holds the whole model's slice, so whoever reaches the
    port can read or overwrite it (docs/design.md §6.1). Another address needs TLS or tokens, or
    ``insecure=True``.
    """

    def __init__(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        config: ServerConfig | None = None,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: list[Any] | None = None,
        peer_credentials: grpc.ChannelCredentials | None = None,
        **settings: Any,
    ) -> None:
        """Either ``config`` (server/config.py), or its settings as keywords (``max_memory=``,
        ``tls_cert=``, ``max_workers=``, ...: each field of ``ServerConfig`` and its groups,
        with ``max_workers`` and ``reserved_workers`` for ``CallLimits``' ``workers`` and
        ``reserved``), from which one is built and checked.

        Runtime objects are not settings: ``credentials`` (``grpc.ServerCredentials``) stands in
        for the TLS settings, ``interceptors`` run on every call (a server with them has no
        sessions, so that every call passes them), and ``peer_credentials`` replace the TLS this
        server's replica calls to the other servers use (server/replication/replicator.py).

        With mutual TLS, ``security.peer_identities`` name the client certificates that have the
        ``peer`` role without a token (the servers' own), and ``local_calls=False`` makes
        clients in this process go through gRPC like any other (otherwise a plain server — no
        TLS, tokens or interceptors — is called directly, as gloo/NCCL short-cut a rank's own
        part: protos/local_servers.py).
        """
        if config is None:
            placed = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
            config = ServerConfig.from_options(**placed, **settings)
        elif settings or host is not None or port is not None:
            raise TypeError("ShardServer: pass config=ServerConfig(...) or settings, not both")
        self.config = config
        security, bounds = config.security, config.bounds
        if credentials is not None and security.tls:
            raise ValueError("pass either credentials or tls_cert/tls_key/tls_ca, not both")
        if credentials is None:
            credentials = tls.server_credentials(
                security.tls_cert, security.tls_key, security.tls_ca
            )
        checked_tokens = dict(security.tokens)
        host = config.host
        self.exposed = tls.check_binding(
            host,
            tls=credentials is not None,
            tokens=bool(checked_tokens),
            insecure=security.insecure,
        )
        self.tls = credentials is not None
        self.mutual_tls = self.tls and security.tls_ca is not None
        self.limits = config.threads
        if interceptors:  # a session's calls would pass the interceptors as one call
            self.limits = dataclasses.replace(self.limits, max_sessions=0)
        backend.use_device(config.device)
        self.host = host
        max_memory = bounds.max_memory
        memory = default_memory_limit() if max_memory is None else parse_bytes(max_memory)
        self.servicer = ShardServicer(
            max_wait_s=bounds.max_wait_s,
            max_job_bytes=bounds.max_job_bytes,
            max_slot_bytes=bounds.max_slot_bytes,
            snapshot_dir=config.snapshot_dir,
            max_memory=memory,
            pending_ttl_s=bounds.pending_ttl_s,
        )
        # Contributions that came before their turn wait for it on a quarter of the threads
        # waiting calls may take (server/runtime/turns.py); the rest stay free for the ones
        # they wait for. One bound for pushes and slot contributions.
        self.servicer.buffers.turns.limit = (self.limits.workers - self.limits.reserved) // 4
        max_receive_bytes = bounds.max_receive_bytes
        segments = self.servicer.segments  # a payload in shared memory is no larger than a message
        segments.max_segment_bytes = min(segments.max_segment_bytes, max_receive_bytes)
        self.servicer.slots.max_chunk_bytes = max_receive_bytes  # no larger chunk can arrive
        self.sweeper = Sweeper(
            [
                self.servicer.slots.expire,
                self.servicer.leases.sweep,
                self.servicer.membership.sweep,
                self.servicer.segments.expire,
            ],
            sweep_period(bounds.pending_ttl_s),
        )
        if peer_credentials is None and self.tls:
            peer_credentials = tls.peer_channel_credentials(
                security.tls_cert, security.tls_key, security.tls_ca, security.peer_tls_ca
            )
        peer_identities = security.peer_identities
        self.servicer.replicator.set_ttl(bounds.replica_ttl_s)
        self.servicer.replicator.set_transport(
            peer_token=tokens.peer_token(checked_tokens),
            tokens_required=bool(checked_tokens) and not peer_identities,
            credentials=peer_credentials,
        )
        metrics_port, metrics_host = config.metrics_port, config.metrics_host
        # First is outermost: metrics also see the calls that authentication rejects.
        chain: list[Any] = []
        self.metrics = None
        if metrics_port is not None:
            from paramshard.server.metrics import (
                ServerMetrics,  # needs prometheus_client: only on demand
            )

            self.metrics = ServerMetrics(self.servicer)
            chain.append(self.metrics.interceptor)
        role_of = scope_of = None
        if checked_tokens or peer_identities:
            token_auth = auth.TokenAuthInterceptor(checked_tokens, peer_identities)
            chain.append(token_auth)
            role_of, scope_of = token_auth.caller_role, token_auth.caller_scope
            self.servicer.scope_of = token_auth.context_scope  # Status, listings: in scope only
            self.servicer.segments.role_of = role_of  # read tokens' segments: their own pool
            if self.metrics is not None and checked_tokens:  # scrapes need a token too
                self.metrics.grant = token_auth.grant
        chain.extend(interceptors or [])
        self._local_ok = config.local_calls and not chain and credentials is None
        self._local: local_servers.LocalServer | None = None
        # Innermost: counts only calls that passed authentication. In-process calls (above)
        # take no gRPC thread, so they pass no gate.
        self.gate = CallGate(
            self.limits, role_of, self.servicer.may_wait, self.servicer.reply_bytes
        )
        chain.append(self.gate)
        self.servicer.wait_in = self.gate.wait_in
        self._max_receive_bytes = max_receive_bytes
        options = [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
            # calls not taken up yet: past the first, gRPC cancels some at random, past the
            # second all (CallLimits.max_pending_calls; one bound, so none at random)
            ("grpc.server.max_pending_requests", self.limits.max_pending_calls),
            ("grpc.server.max_pending_requests_hard_limit", self.limits.max_pending_calls),
            ("grpc.keepalive_timeout_ms", int(TCP_USER_TIMEOUT_S * 1000)),
            # A ping of any kind (gRPC's flow-control probes too) unanswered this long
            # closes the connection: gRPC's default, a minute, took a rank stopped mid-call
            # for dead (PING_TIMEOUT_MS)
            ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
            (
                "grpc.server_max_unrequested_time_in_server",
                max(GRPC_UNTAKEN_S, math.ceil(bounds.max_wait_s)),
            ),
        ]
        # Waiting handlers (pull at a version, read a slot) hold a thread each: the gate keeps
        # some free for the calls that work, and gives the open streams threads of their own.
        self._pool = futures.ThreadPoolExecutor(
            self.limits.threads, thread_name_prefix="shard", initializer=name_this_thread
        )
        self._server = grpc.server(
            self._pool,
            options=options,
            maximum_concurrent_rpcs=None,
            interceptors=chain,
        )
        self._server.add_generic_rpc_handlers((self.servicer.generic_handler(config.fast_codec),))
        self.sessions = Sessions(
            self.servicer.session_handlers,
            self.gate,
            role_of,
            self.servicer.may_wait,
            self.limits.workers,
            self.metrics.observe if self.metrics is not None else None,
            self.servicer.reply_bytes,
            scope_of=scope_of,
        )
        self.sweeper.sweeps.append(self.sessions.line.expire)  # calls whose time ran out in line
        if self.limits.max_sessions:
            self._server.add_generic_rpc_handlers((self.sessions.generic_handler(),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        port = config.port
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if credentials is None:
            self.port = self._server.add_insecure_port(target)
        else:
            self.port = self._server.add_secure_port(target, credentials)
        if self.port == 0:
            raise OSError(f"cannot bind a shard server to {target}")
        self.metrics_host = host if metrics_host is None else metrics_host
        self._metrics_port = metrics_port
        self.metrics_port: int | None = None
        """The bound metrics port once started (None without metrics)."""
        self._stop_lock = threading.Lock()
        self._stopped = False
        closing.close_at_exit(self, lambda server: server.stop(0))

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        if self.metrics_port is None:
            return None
        host = "127.0.0.1" if self.metrics_host in ("0.0.0.0", "") else self.metrics_host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.metrics_port}/metrics"

    def start(self) -> ShardServer:
        if self.metrics is not None and self.metrics_port is None:
            assert self._metrics_port is not None
            try:
                self.metrics_port = self.metrics.serve(self.metrics_host, self._metrics_port)
            except OSError as exc:
                self._server.stop(0)  # release the gRPC port bound in __init__
                where = f"{self.metrics_host}:{self._metrics_port}"
                raise OSError(f"cannot serve metrics on {where}: {exc}") from exc
        self._server.start()
        self.sweeper.start()
        if self._local_ok:
            self._local = local_servers.LocalServer(
                self.servicer.call_local,
                frozenset(ShardServicer.LOCAL_METHODS),
                self._max_receive_bytes,
                backend.device,
            )
            local_servers.register(self.address, self._local)
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float | None = None) -> None:
        """Stops serving; idempotent. New calls are refused at once and lease streams end
        (their ranks' clients see the server go, nothing is decided about them); running calls
        get ``grace`` seconds (None: none); then every call still waiting ends (a slot read, a
        pull or step waiting for a version) and the server's threads are told to end, so
        every handler thread returns and the process can exit."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        closing.forget(self)
        if self._local is not None:
            local_servers.unregister(self.address, self._local)
        # Health watchers learn NOT_SERVING first. Bounded: once, with outside clients holding
        # Health.Watch streams, this call did not return; the stop must not depend on them.
        notify = threading.Thread(target=self.health.enter_graceful_shutdown, daemon=True)
        notify.start()
        notify.join(timeout=2.0)
        # open streams would hold the grace to its end: lease streams end now, sessions once
        # their calls in flight have replied
        self.servicer.leases.close()
        self.sessions.drain("this server is stopping")
        # gRPC cancels what still runs when the grace ends; a handler blocked in one of our
        # waits does not notice, and Python's exit joins the pool's threads: so the waits end
        # here (a `paramshard serve` that printed "stopped" and never exited was that).
        self._server.stop(grace).wait((grace or 0.0) + STOP_MARGIN_S)
        self.servicer.close("this server stopped")
        self.sweeper.stop()
        self.sessions.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.servicer.replicator.close()
        self.servicer.segments.close()
        if self.metrics is not None:
            self.metrics.close()

    def wait(self) -> None:
        self._server.wait_for_termination()

    def __enter__(self) -> ShardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
