"""The HTTP side of a server's metrics (server/metrics.py): ``/metrics`` served on a daemon
thread, refusals with their HTTP status, and what a token scoped to jobs may see.

Needs ``prometheus_client``, as server/metrics.py does (only imported when metrics are asked
for).
"""

from __future__ import annotations

import copy
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from paramshard.server.rpc.scopes import Scope

__all__ = ["Endpoint", "InScope", "serve"]

REQUEST_TIMEOUT_S = 10.0
"""How long a connection may take to send its request, and then to read the reply, in all: one
that takes longer is closed instead of holding a thread (``_Deadline``)."""
MAX_CONNECTIONS = 32
"""Connections served at once; one more is closed at once (a Prometheus server scrapes with
one, so these are for several scrapers, not for a client that opens many)."""

Render = Callable[["Scope | None"], bytes]
Authorize = Callable[[str | None], "tuple[int, str, Scope | None]"]


class Endpoint:
    """A running ``/metrics`` endpoint: its bound port, and ``close``."""

    def __init__(self, http: ThreadingHTTPServer) -> None:
        self._http = http
        self.port = int(http.server_address[1])
        self._thread = threading.Thread(
            target=http.serve_forever, name="shard-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def serve(host: str, port: int, render: Render, authorize: Authorize) -> Endpoint:
    """Serves ``render(scope)`` at ``/metrics`` (and ``/``) on ``host:port`` to whoever
    ``authorize`` (given the ``Authorization`` header) lets in: (HTTP status, why refused,
    scope)."""

    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S  # each read and write; the whole request: ``_Deadline``

        def setup(self) -> None:
            super().setup()
            self.deadline = _Deadline(self.connection)

        def parse_request(self) -> bool:  # the request line and headers are read
            parsed = super().parse_request()
            if not self.deadline.restart():  # the reply has as long
                self.close_connection = True  # headers cut short by the deadline: no reply
                return False
            return parsed

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                self.deadline.cancel()

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served here")
                return
            status, why, scope = authorize(self.headers.get("Authorization"))
            if status != 200:
                self.refuse(status, why)
                return
            body = render(scope)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def refuse(self, status: int, why: str) -> None:
            body = (why + "\n").encode()
            self.send_response(status)
            if status == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="paramshard"')
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # one line per scrape on stderr helps no one

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        def process_request(self, request: Any, client_address: Any) -> None:
            if not self.slots.acquire(blocking=False):  # full: this one is closed unserved
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                self.slots.release()
                raise

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                self.slots.release()

    return Endpoint(Server((host, port), Handler))


class _Deadline:
    """Shuts a connection down ``REQUEST_TIMEOUT_S`` after it was (re)started. The socket's
    timeout bounds each read only: 32 connections that sent a byte of their headers a second
    held every slot (``MAX_CONNECTIONS``), and a scrape with a valid token was closed unserved,
    for as long as they went on; the token is read only once the headers are in."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._expired = False
        self.restart()

    def restart(self) -> bool:
        """Starts the time again; False (and nothing started) once it ran out."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            if self._expired:
                return False
            self._timer = threading.Timer(REQUEST_TIMEOUT_S, self._expire)
            self._timer.daemon = True
            self._timer.start()
            return True

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            self._expired = True
        try:  # a read or write blocked on it returns at once
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already


class InScope:
    """What a token scoped to jobs may scrape of ``registry``: the series whose ``job`` label
    is in its scope, and those that name no job (bytes and latency by method, memory, the
    process), as Status shows it (server/status.py)."""

    def __init__(self, registry: CollectorRegistry, scope: Scope) -> None:
        self.registry, self.scope = registry, scope

    def collect(self) -> Iterator[Any]:
        for family in self.registry.collect():
            kept = [
                s
                for s in family.samples
                if "job" not in s.labels or self.scope.allows_job(s.labels["job"])
            ]
            if len(kept) == len(family.samples):
                yield family
                continue
            narrowed = copy.copy(family)
            narrowed.samples = kept
            yield narrowed
