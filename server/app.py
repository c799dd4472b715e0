"""``ShardServer``: one shard server, in-process (tests, notebooks) or as ``paramshard serve``."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from paramshard.protos import local_servers
from paramshard.server import auth, backend
from paramshard.server.admission import CallGate, CallLimits, default_reserved
from paramshard.server.expiry import Sweeper, sweep_period
from paramshard.server.limits import default_memory_limit, parse_bytes
from paramshard.server.servicer import SERVICE_NAME, ShardServicer
from paramshard.server.sessions import Sessions

__all__ = ["ShardServer", "MALLOC_ENV"]

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
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        device: str = "cpu",
        max_workers: int = 128,
        reserved_workers: int | None = None,
        max_waiting_read: int = 16,
        max_streams: int = 4,
        max_sessions: int = 64,
        max_receive_bytes: int = 256 * 2**20,
        max_wait_s: float = 120.0,
        max_job_bytes: int = 0,
        max_memory: int | str | None = None,
        pending_ttl_s: float = 600.0,
        max_slot_bytes: int = 0,
        snapshot_dir: str | None = None,
        fast_codec: bool = True,
        tls_cert: bytes | str | None = None,
        tls_key: bytes | str | None = None,
        tls_ca: bytes | str | None = None,
        tokens: Mapping[str, str] | None = None,
        insecure: bool = False,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: list[Any] | None = None,
        local_calls: bool = True,
        peer_tls_ca: bytes | str | None = None,
        peer_credentials: grpc.ChannelCredentials | None = None,
        replica_ttl_s: float = 300.0,
        peer_identities: Sequence[str] = (),
    ) -> None:
        """``tls_cert``/``tls_key`` (PEM) serve TLS; ``tls_ca`` (PEM) also requires client
        certificates it signed (mutual TLS). ``credentials`` may stand in for all three.
        ``tokens`` ({token: role}, roles read < train < admin) require an ``authorization:
        Bearer TOKEN`` header on every Shard call (server/auth.py). A ``host`` other than
        loopback needs TLS or tokens unless ``insecure=True`` (ValueError otherwise).
        ``metrics_port`` (0 picks one) serves Prometheus metrics at
        ``http://metrics_host:port/metrics``; ``metrics_host`` defaults to ``host``.
        ``local_calls=False`` makes clients in this process go through gRPC like any other
        (tests of the wire path; otherwise a plain server — no TLS, tokens or interceptors — is
        called directly, skipping the encode, the copies and the loopback TCP, as gloo/NCCL
        short-cut a rank's own part: protos/local_servers.py).

        Replicas (server/replication.py) go to the other servers with the ``peer`` token of
        ``tokens`` (role ``peer``: every server lists the same one), over TLS when this server
        serves TLS: the other servers' certificates are checked against ``peer_tls_ca`` (PEM;
        default ``tls_ca``, else the system's roots), and with mutual TLS (``tls_ca``) this
        server presents its own ``tls_cert``, which then needs the clientAuth usage too.
        ``peer_credentials`` replaces all of that. An incomplete replica is dropped after
        ``replica_ttl_s`` seconds without a chunk. ``peer_identities`` (mutual TLS only): a
        client certificate whose common name or a DNS alternative name is one of them has the
        ``peer`` role without a token (the servers' own certificates), so no peer token is
        needed.

        Bounds (docs/design.md §6.2): ``max_memory`` (bytes, or a size such as ``"8GiB"`` or
        ``"50%"``; None: 90% of the host's memory, or of the device's on a GPU; 0: no limit)
        is what this server may hold for its callers: buffers, staged gradients, slots,
        mailboxes and replicas (server/limits.py). Slots and mailboxes untouched for
        ``pending_ttl_s`` seconds expire. ``max_workers`` threads run calls; calls that wait
        (pulls at a version, slot reads, ...) never take the last ``reserved_workers`` of
        them (None: a quarter, at most 16), ``read`` tokens' waiting calls are at most
        ``max_waiting_read``, and reflection and health Watch streams at most
        ``max_streams``, on threads of their own: beyond a bound, RESOURCE_EXHAUSTED at once
        (server/admission.py). No call waits longer than ``max_wait_s``. Clients keep one
        session each (a stream carrying their data-plane calls, server/sessions.py), at most
        ``max_sessions`` at once (0: none); a server with ``interceptors`` has none, so that
        every call passes them.
        """
        if credentials is not None and (tls_cert or tls_key or tls_ca):
            raise ValueError("pass either credentials or tls_cert/tls_key/tls_ca, not both")
        if credentials is None:
            credentials = auth.server_credentials(tls_cert, tls_key, tls_ca)
        checked_tokens = auth.check_tokens(tokens or {})
        if peer_identities and tls_ca is None:
            raise ValueError(
                "peer identities are read from client certificates: they need mutual TLS"
                " (tls_ca, which makes the server require client certificates)"
            )
        self.exposed = auth.check_binding(
            host, tls=credentials is not None, tokens=bool(checked_tokens), insecure=insecure
        )
        self.tls = credentials is not None
        self.mutual_tls = self.tls and tls_ca is not None
        if max_wait_s <= 0 or pending_ttl_s <= 0:
            raise ValueError(
                f"max_wait_s ({max_wait_s}) and pending_ttl_s ({pending_ttl_s}) must be > 0"
            )
        if reserved_workers is None:
            reserved_workers = default_reserved(max_workers)
        if interceptors:
            max_sessions = 0  # a session's calls would pass the interceptors as one call
        self.limits = CallLimits(
            max_workers, reserved_workers, max_waiting_read, max_streams, max_sessions
        )
        backend.use_device(device)
        self.host = host
        memory = default_memory_limit() if max_memory is None else parse_bytes(max_memory)
        self.servicer = ShardServicer(
            max_wait_s=max_wait_s,
            max_job_bytes=max_job_bytes,
            max_slot_bytes=max_slot_bytes,
            snapshot_dir=snapshot_dir,
            max_memory=memory,
            pending_ttl_s=pending_ttl_s,
        )
        segments = self.servicer.segments  # a payload in shared memory is no larger than a message
        segments.max_segment_bytes = min(segments.max_segment_bytes, max_receive_bytes)
        self.sweeper = Sweeper(
            [self.servicer.slots.expire, self.servicer.leases.sweep, self.servicer.segments.expire],
            sweep_period(pending_ttl_s),
        )
        if peer_credentials is None and self.tls:
            peer_credentials = auth.peer_channel_credentials(tls_cert, tls_key, tls_ca, peer_tls_ca)
        self.servicer.replicator.set_ttl(replica_ttl_s)
        self.servicer.replicator.set_transport(
            peer_token=auth.peer_token(checked_tokens),
            tokens_required=bool(checked_tokens) and not peer_identities,
            credentials=peer_credentials,
        )
        # First is outermost: metrics also see the calls that authentication rejects.
        chain: list[Any] = []
        self.metrics = None
        if metrics_port is not None:
            from paramshard.server.metrics import (
                ServerMetrics,  # needs prometheus_client: only on demand
            )

            self.metrics = ServerMetrics(self.servicer)
            chain.append(self.metrics.interceptor)
        role_of = None
        if checked_tokens or peer_identities:
            token_auth = auth.TokenAuthInterceptor(checked_tokens, peer_identities)
            chain.append(token_auth)
            role_of = token_auth.caller_role
        chain.extend(interceptors or [])
        self._local_ok = local_calls and not chain and credentials is None
        self._local: local_servers.LocalServer | None = None
        # Innermost: counts only calls that passed authentication. In-process calls (above)
        # take no gRPC thread, so they pass no gate.
        self.gate = CallGate(self.limits, role_of, self.servicer.may_wait)
        chain.append(self.gate)
        self._max_receive_bytes = max_receive_bytes
        options = [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
        ]
        # Waiting handlers (pull at a version, read a slot) hold a thread each: the gate keeps
        # some free for the calls that work, and gives the open streams threads of their own.
        self._server = grpc.server(
            futures.ThreadPoolExecutor(self.limits.threads, thread_name_prefix="shard"),
            options=options,
            maximum_concurrent_rpcs=None,
            interceptors=chain,
        )
        self._server.add_generic_rpc_handlers((self.servicer.generic_handler(fast_codec),))
        self.sessions = Sessions(
            self.servicer.session_handlers,
            self.gate,
            role_of,
            self.servicer.may_wait,
            self.limits.workers,
            self.metrics.observe if self.metrics is not None else None,
        )
        if self.limits.max_sessions:
            self._server.add_generic_rpc_handlers((self.sessions.generic_handler(),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
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
        if self._local is not None:
            local_servers.unregister(self.address, self._local)
        # Health watchers learn NOT_SERVING first. Bounded: once, with outside clients holding
        # Health.Watch streams, this call did not return; the stop must not depend on them.
        notify = threading.Thread(target=self.health.enter_graceful_shutdown, daemon=True)
        notify.start()
        notify.join(timeout=2.0)
        self._server.stop(grace).wait()
        self.sweeper.stop()
        self.sessions.close()
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
