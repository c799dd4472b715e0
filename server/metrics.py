"""Prometheus metrics of one shard server, served over HTTP (``ShardServer(metrics_port=P)``).

Exposed at ``http://HOST:P/metrics`` in the Prometheus text format:

- ``paramshard_rpc_request_bytes_total{method}`` / ``paramshard_rpc_response_bytes_total{method}``:
  bytes of the serialised messages received and sent (gRPC framing not included);
- ``paramshard_rpc_duration_seconds{method,code}``: handler time of unary calls, waits included
  (a pull at a future version counts the time it waited);
- ``paramshard_held_bytes{kind}``: params / grads / optimizer / slots held now;
- ``paramshard_memory_reserved_bytes{kind}`` and ``paramshard_memory_limit_bytes``: what is
  reserved against the server's memory limit (buffers / staging / slots / replicas, see
  server/runtime/limits.py) and the limit itself (``--max-memory``; 0: none);
- ``paramshard_last_step_seconds{job,buffer}`` and ``paramshard_buffer_version{job,buffer}``:
  the duration of each buffer slice's latest optimizer step and its version;
- ``paramshard_skipped_steps_total{job,buffer}``: steps skipped because their reduced gradient
  held NaN or Inf (server/buffers/nonfinite.py);
- ``paramshard_elastic_members{job}``, ``paramshard_elastic_joins_total{job}``,
  ``paramshard_elastic_leaves_total{job}``, ``paramshard_elastic_revisions_total{job}`` and
  ``paramshard_elastic_steps_total{job,world_size}``: the elastic jobs this server coordinates
  (server/collectives/membership.py): members of the newest step, ranks that joined and left,
  steps whose membership changed mid-step, steps decided at each world size;
- ``paramshard_jobs``, ``paramshard_buffers``, ``paramshard_open_slots`` (counts over the whole
  server), ``paramshard_uptime_seconds``, plus the ``process_*`` metrics (memory, CPU, file
  descriptors) of the server process.

Held bytes and step times are read from the store at scrape time, so nothing is added to the
hot path but two counter increments and one histogram observation per call. Methods are labelled
by name (``PushGrad``) for the Shard service and ``service/Method`` for the others (health).

A server with tokens serves its metrics only to a bearer token of role ``read`` or above
(``Authorization: Bearer TOKEN``, a Prometheus scrape's ``authorization`` setting), and a token
scoped to jobs sees only their series and those that name no job; 401 and 403 otherwise. A
server without tokens serves them to whoever reaches ``--metrics-host``.

Needs ``prometheus_client`` (pure Python); only imported when metrics are asked for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import generate_latest
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shard server metrics need the prometheus-client package: pip install prometheus-client"
    ) from exc

from paramshard.server import metrics_http
from paramshard.server.rpc.auth import SERVICE_NAME, bearer, role_allows

if TYPE_CHECKING:
    from paramshard.server.rpc.scopes import Grant, Scope
    from paramshard.server.servicer import ShardServicer

__all__ = ["ServerMetrics", "MetricsInterceptor", "LATENCY_BUCKETS"]

# Pulls and slot reads may wait for a step (up to the server's max wait): buckets reach 10 min.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


def method_label(full_method: str) -> str:
    service, _, method = full_method.lstrip("/").rpartition("/")
    return method if service == SERVICE_NAME else f"{service}/{method}"


class _StoreCollector:
    """Reads held bytes, step times and versions from the servicer at scrape time."""

    def __init__(self, servicer: ShardServicer) -> None:
        self.servicer = servicer

    def describe(self) -> list:
        return []  # computed at scrape time: nothing to check at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = {"params": 0, "grads": 0, "optimizer": 0}
        step = GaugeMetricFamily(
            "paramshard_last_step_seconds",
            "Duration of the latest optimizer step of each buffer slice on this server",
            labels=["job", "buffer"],
        )
        version = GaugeMetricFamily(
            "paramshard_buffer_version",
            "Optimizer steps applied to each buffer slice on this server",
            labels=["job", "buffer"],
        )
        skipped = CounterMetricFamily(
            "paramshard_skipped_steps",
            "Steps of each buffer slice skipped because their reduced gradient was not finite",
            labels=["job", "buffer"],
        )
        jobs = self.servicer.buffers.jobs()
        n_buffers = 0
        for job, buffers in sorted(jobs.items()):
            for b in buffers:
                # No lock: a scrape must not wait behind a long optimizer step; these are
                # single attribute reads, at worst one step stale.
                params, grads, opt = b.bytes_by_kind()
                held["params"] += params
                held["grads"] += grads
                held["optimizer"] += opt
                step.add_metric([job, b.name], b.last_step_seconds)
                version.add_metric([job, b.name], b.version)
                skipped.add_metric([job, b.name], b.skipped_steps)
                n_buffers += 1
        slot_bytes, open_slots = self.servicer.slots.usage()
        held["slots"] = slot_bytes
        by_kind = GaugeMetricFamily(
            "paramshard_held_bytes",
            "Bytes held on this server by kind: params, grads, optimizer state, collective slots",
            labels=["kind"],
        )
        for kind, value in held.items():
            by_kind.add_metric([kind], value)
        yield by_kind
        budget = self.servicer.budget
        reserved = GaugeMetricFamily(
            "paramshard_memory_reserved_bytes",
            "Bytes reserved against this server's memory limit, by kind",
            labels=["kind"],
        )
        for kind, value in budget.usage().items():
            reserved.add_metric([kind], value)
        yield reserved
        yield GaugeMetricFamily(
            "paramshard_memory_limit_bytes",
            "This server's memory limit (--max-memory); 0: none",
            value=budget.limit,
        )
        yield step
        yield version
        yield skipped
        yield GaugeMetricFamily("paramshard_jobs", "Jobs on this server", value=len(jobs))
        yield GaugeMetricFamily("paramshard_buffers", "Buffer slices on this server", n_buffers)
        yield GaugeMetricFamily("paramshard_open_slots", "Open collective slots", open_slots)
        yield GaugeMetricFamily(
            "paramshard_uptime_seconds",
            "Seconds since this server started",
            time.time() - self.servicer.started,
        )
        yield from _membership_metrics(self.servicer.membership.status())


def _membership_metrics(rows: list[Any]) -> Iterator[GaugeMetricFamily]:
    """The elastic jobs this server coordinates (server/collectives/membership.py)."""
    members = GaugeMetricFamily(
        "paramshard_elastic_members", "Members of each elastic job's newest step", labels=["job"]
    )
    counts = {
        name: CounterMetricFamily(f"paramshard_elastic_{name}", text, labels=["job"])
        for name, text in (
            ("joins", "Ranks that joined each elastic job (its first step's included)"),
            ("leaves", "Ranks that left each elastic job, were lost or sat a step out"),
            ("revisions", "Steps of each elastic job whose membership changed mid-step"),
        )
    }
    steps = CounterMetricFamily(
        "paramshard_elastic_steps",
        "Steps of each elastic job decided at each world size",
        labels=["job", "world_size"],
    )
    for m in rows:
        members.add_metric([m.job], len(m.members))
        counts["joins"].add_metric([m.job], m.joins)
        counts["leaves"].add_metric([m.job], m.leaves)
        counts["revisions"].add_metric([m.job], m.revisions)
        for size, n in sorted(m.steps_by_world_size.items()):
            steps.add_metric([m.job, str(size)], n)
    yield members
    yield from counts.values()
    yield steps


class ServerMetrics:
    """The metrics of one server: its own registry, so several servers can share a process."""

    def __init__(self, servicer: ShardServicer) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.request_bytes = Counter(
            "paramshard_rpc_request_bytes",
            "Bytes of serialised request messages received, by method",
            ["method"],
            registry=self.registry,
        )
        self.response_bytes = Counter(
            "paramshard_rpc_response_bytes",
            "Bytes of serialised response messages sent, by method",
            ["method"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "paramshard_rpc_duration_seconds",
            "Time in the handler of unary calls (waits included), by method and status code",
            ["method", "code"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StoreCollector(servicer))  # type: ignore[arg-type]
        ProcessCollector(registry=self.registry)
        self.interceptor = MetricsInterceptor(self)
        self.grant: Callable[[str], Grant | None] | None = None
        """Set by a server that has tokens (``TokenAuthInterceptor.grant``): a scrape must then
        present one of role ``read`` or above, and a token scoped to jobs sees only their
        series (``authorize``). Without tokens, anyone who reaches the port may scrape."""
        self._http: metrics_http.Endpoint | None = None

    def observe(
        self, method: str, code: grpc.StatusCode, seconds: float, received: int, sent: int
    ) -> None:
        """One call of a session (server/transport/sessions.py), counted as its unary twin would be
        (the session's frames count under ``Session`` too)."""
        self.latency.labels(method, code.name).observe(seconds)
        self.request_bytes.labels(method).inc(received)
        self.response_bytes.labels(method).inc(sent)

    def render(self, scope: Scope | None = None) -> bytes:
        """The current metrics in the Prometheus text format; with ``scope``, only the series
        of its jobs and those that name no job."""
        registry = self.registry if scope is None else metrics_http.InScope(self.registry, scope)
        return generate_latest(registry)

    def authorize(self, header: str | None) -> tuple[int, str, Scope | None]:
        """(HTTP status, why refused, scope) of a scrape whose ``Authorization`` header is
        ``header``: 401 without a known bearer token, 403 for a role below ``read`` (``peer``,
        the servers' own), else 200 and the token's scope (None: every job)."""
        if self.grant is None:
            return 200, "", None
        token = bearer([("authorization", header)]) if header is not None else None
        grant = self.grant(token) if token else None
        if grant is None:
            return 401, "this server's metrics need a bearer token (Authorization: Bearer T)", None
        if not role_allows(grant.role, "read"):
            return 403, f"a token of role '{grant.role}' may not read metrics", None
        return 200, "", grant.scope

    def serve(self, host: str, port: int) -> int:
        """Serves ``/metrics`` on ``host:port`` in a daemon thread (server/metrics_http.py);
        returns the bound port."""
        self._http = metrics_http.serve(host, port, self.render, self.authorize)
        return self._http.port

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts message bytes (by wrapping the (de)serialisers) and times unary handlers."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = method_label(handler_call_details.method)
        m = self.metrics
        received = m.request_bytes.labels(method)
        sent = m.response_bytes.labels(method)

        deserialize = handler.request_deserializer
        serialize = handler.response_serializer

        def counted_request(raw: bytes) -> Any:
            received.inc(len(raw))
            return deserialize(raw) if deserialize is not None else raw

        def counted_response(msg: Any) -> bytes:
            raw = serialize(msg) if serialize is not None else msg
            sent.inc(len(raw))
            return raw

        if handler.request_streaming or handler.response_streaming:
            behavior, make = _streaming(handler)
            return make(
                behavior, request_deserializer=counted_request, response_serializer=counted_response
            )

        behavior = handler.unary_unary
        latency = m.latency

        def timed(request: Any, context: grpc.ServicerContext) -> Any:
            began = time.perf_counter()
            code = grpc.StatusCode.UNKNOWN
            try:
                reply = behavior(request, context)
                code = _code(context) or grpc.StatusCode.OK
                return reply
            except BaseException:
                code = _code(context) or grpc.StatusCode.UNKNOWN
                raise
            finally:
                latency.labels(method, code.name).observe(time.perf_counter() - began)

        return grpc.unary_unary_rpc_method_handler(
            timed, request_deserializer=counted_request, response_serializer=counted_response
        )


def _code(context: grpc.ServicerContext) -> grpc.StatusCode | None:
    try:
        code = context.code()  # type: ignore[attr-defined]
    except (AttributeError, NotImplementedError):  # an older grpcio
        return None
    return code if isinstance(code, grpc.StatusCode) else None


def _streaming(handler: grpc.RpcMethodHandler) -> tuple[Any, Callable[..., Any]]:
    """The behaviour of a streaming handler and the constructor of its kind (untimed: a Watch
    stream lasts as long as the client likes)."""
    if handler.request_streaming and handler.response_streaming:
        return handler.stream_stream, grpc.stream_stream_rpc_method_handler
    if handler.request_streaming:
        return handler.stream_unary, grpc.stream_unary_rpc_method_handler
    return handler.unary_stream, grpc.unary_stream_rpc_method_handler
