"""``ServerConfig``: everything a shard server is told, grouped, typed and checked once.

``ShardServer`` takes one (or the same settings as keywords, which build one), and
``paramshard serve`` builds one from its flags, so both get the same checks and the same
messages. A message names the fields it is about (``tls_cert``); ``FLAGS`` maps each field to its
``paramshard serve`` flag, and ``as_flags`` rewrites a message in flags for the command line.

The groups, as torchtitan nests a component's own config: ``SecurityConfig`` (who may call,
docs/security.md), ``BoundsConfig`` (memory and time a caller may take) and ``CallLimits``
(threads, rpc/admission.py). Runtime objects (gRPC credentials, interceptors) are not settings:
``ShardServer`` takes them as keywords of their own.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from paramshard.server.rpc.admission import CallLimits, default_reserved
from paramshard.server.rpc.call_limits import GRPC_INT_MAX
from paramshard.server.rpc.scopes import Grant
from paramshard.server.rpc.tokens import check_tokens
from paramshard.server.runtime.limits import parse_bytes

__all__ = ["BoundsConfig", "CallLimits", "FLAGS", "SecurityConfig", "ServerConfig", "as_flags"]

Pem = bytes | str | os.PathLike | None
"""PEM bytes or text, or a file (a path object) to read it from."""


@dataclass(frozen=True, kw_only=True)
class SecurityConfig:
    """TLS, tokens and the binding rule (docs/security.md)."""

    tls_cert: Pem = None
    """This server's certificate (chain): serve TLS. Needs ``tls_key``."""
    tls_key: Pem = None
    """The private key of ``tls_cert``."""
    tls_ca: Pem = None
    """Require client certificates signed by this CA (mutual TLS). Needs ``tls_cert``."""
    peer_tls_ca: Pem = None
    """The other servers' certificates are checked against it when this server sends them
    replicas over TLS (default ``tls_ca``, else the system's roots). Needs ``tls_cert``."""
    tokens: Mapping[str, str | Grant] = field(default_factory=dict)
    """``{token: role}`` (roles read < train < admin, and peer): every Shard call then needs
    ``authorization: Bearer TOKEN``. A token scoped to jobs and runs maps to its role and
    scope as a token file writes them (``"train jobs=team-a-*"``) or to a ``Grant``
    (server/rpc/scopes.py); once checked, an unscoped token maps to its role and a scoped one
    to its ``Grant``."""
    peer_identities: tuple[str, ...] = ()
    """Client certificates whose CN or a DNS name is one of these have the ``peer`` role without
    a token. Needs ``tls_ca``."""
    insecure: bool = False
    """Allow a non-loopback host without TLS or tokens."""

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        for name in ("tls_ca", "peer_tls_ca"):
            if getattr(self, name) is not None and self.tls_cert is None:
                raise ValueError(f"{name} needs the server's own tls_cert and tls_key")
        if self.peer_identities and self.tls_ca is None:
            raise ValueError(
                "peer_identities are read from client certificates: they need mutual TLS"
                " (tls_ca, which makes the server require client certificates)"
            )
        for name in ("tls_cert", "tls_key", "tls_ca", "peer_tls_ca"):
            object.__setattr__(self, name, _pem(name, getattr(self, name)))
        object.__setattr__(self, "tokens", check_tokens(self.tokens))
        object.__setattr__(self, "peer_identities", tuple(self.peer_identities))

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


@dataclass(frozen=True, kw_only=True)
class BoundsConfig:
    """Memory and time a caller may take (docs/design.md §6.2)."""

    max_memory: int | str | None = None
    """Bytes this server may hold for callers (``"8GiB"``, ``"50%"``; None: 90% of the host's or
    device's memory; 0: no limit): buffers, staged gradients, slots, mailboxes, replicas."""
    max_job_bytes: int = 0
    """Bytes one job may hold (0: no limit)."""
    max_slot_bytes: int = 0
    """Bytes all reduction slots and mailboxes may hold (0: only ``max_memory``)."""
    max_receive_bytes: int = 256 * 2**20
    """The largest request accepted."""
    max_wait_s: float = 120.0
    """The longest any call waits (a pull at a future version, a slot read, a step); also
    how long a call that came while the server's Python threads stalled waits to be taken up
    (at least 30 s: server/app.py ``GRPC_UNTAKEN_S``)."""
    pending_ttl_s: float = 600.0
    """Slots and mailboxes untouched this long expire; their readers get ABORTED."""
    replica_ttl_s: float = 300.0
    """An incomplete replica with no chunk for this long is dropped."""

    def __post_init__(self) -> None:
        for name in ("max_wait_s", "pending_ttl_s", "replica_ttl_s"):
            value = getattr(self, name)  # gRPC takes the wait as 32-bit seconds (server/app.py)
            if not isinstance(value, (int, float)) or not 0 < value <= GRPC_INT_MAX:
                raise ValueError(
                    f"{name} must be a number of seconds in (0, 2**31 - 1], got {value!r}"
                )
        for name in ("max_job_bytes", "max_slot_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.max_receive_bytes, int) or not (
            1024 <= self.max_receive_bytes <= GRPC_INT_MAX
        ):
            raise ValueError(
                "max_receive_bytes must be an int in 1024..2**31 - 1 (2 GiB less a byte), got"
                f" {self.max_receive_bytes!r}"
            )
        if self.max_memory is not None:
            parse_bytes(self.max_memory)  # raises ValueError naming what it could not read


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """One shard server's settings (``ShardServer(config=...)``, ``paramshard serve``)."""

    host: str = "127.0.0.1"
    """Address to listen on; beyond loopback it needs TLS or tokens, or ``insecure``."""
    port: int = 0
    """Port; 0 picks a free one."""
    device: str = "cpu"
    """Where slices live: ``cpu`` or ``cuda:N``."""
    snapshot_dir: str | None = None
    """Where snapshots are written and read."""
    fast_codec: bool = True
    """Tensor payloads through the hand-encoded codec (False: the protobuf runtime)."""
    local_calls: bool = True
    """Clients in this process call a plain server directly (protos/local_servers.py)."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    bounds: BoundsConfig = field(default_factory=BoundsConfig)
    threads: CallLimits = field(default_factory=CallLimits)
    metrics_port: int | None = None
    """Serve Prometheus metrics at ``http://metrics_host:port/metrics`` (0 picks a port)."""
    metrics_host: str | None = None
    """The metrics endpoint's address (default ``host``)."""

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= 65535):
                raise ValueError(f"{name} must be 0..65535, got {value!r}")
        if not isinstance(self.host, str):
            raise ValueError(f"host must be a string, got {self.host!r}")
        object.__setattr__(self, "host", self.host.strip("[]"))

    @classmethod
    def from_options(cls, **options: Any) -> ServerConfig:
        """A config from the flat keywords ``ShardServer`` takes (``max_memory=...``,
        ``tls_cert=...``, ``max_workers=...``): each goes to its group."""
        groups: dict[str, dict[str, Any]] = {"security": {}, "bounds": {}, "threads": {}}
        top: dict[str, Any] = {}
        for name, value in options.items():
            group = _GROUP_OF.get(name)
            if group is None:
                raise TypeError(f"ShardServer got an unexpected setting {name!r}")
            (top if group == "" else groups[group])[_FIELD_OF.get(name, name)] = value
        threads = groups["threads"]
        if threads.get("reserved") is None:
            threads["reserved"] = default_reserved(threads.get("workers", 128))
        return cls(
            security=SecurityConfig(**groups["security"]),
            bounds=BoundsConfig(**groups["bounds"]),
            threads=CallLimits(**threads),
            **top,
        )


def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


_FIELD_OF = {"max_workers": "workers", "reserved_workers": "reserved"}
"""ShardServer's keyword -> CallLimits' field, where they differ."""
_GROUP_OF = {
    **dict.fromkeys(_names(SecurityConfig), "security"),
    **dict.fromkeys(_names(BoundsConfig), "bounds"),
    **dict.fromkeys(_FIELD_OF, "threads"),
    **{k: "threads" for k in _names(CallLimits) if k not in _FIELD_OF.values()},
    **{k: "" for k in _names(ServerConfig) if k not in ("security", "bounds", "threads")},
}
"""ShardServer's keyword -> the group it belongs to ("" for ServerConfig's own fields)."""

FLAGS = {
    "tls_cert": "--tls-cert",
    "tls_key": "--tls-key",
    "tls_ca": "--tls-ca",
    "peer_tls_ca": "--peer-ca",
    "peer_identities": "--peer-identity",
    "tokens": "--token-file",
    "insecure": "--insecure",
    "max_memory": "--max-memory",
    "max_job_bytes": "--max-job-gb",
    "max_receive_bytes": "--max-receive-mb",
    "max_wait_s": "--max-wait-s",
    "pending_ttl_s": "--pending-ttl",
    "workers": "--workers",
    "reserved": "--reserved-workers",
    "max_waiting_read": "--max-waiting-read",
    "max_streams": "--max-streams",
    "max_sessions": "--max-sessions",
    "max_pending_calls": "--max-pending-calls",
    "metrics_port": "--metrics-port",
    "port": "--port",
}
"""A field -> its ``paramshard serve`` flag."""


def as_flags(message: str) -> str:
    """``message`` with the field names it mentions replaced by their flags (the CLI's words)."""
    pattern = r"(?<![\w.-])(?:CallLimits\.)?(" + "|".join(sorted(FLAGS, key=len, reverse=True))
    return re.sub(pattern + r")\b", lambda m: FLAGS[m.group(1)], message)


def _pem(name: str, value: Pem) -> bytes | None:
    """PEM bytes of ``value``, read from its file when it is a path; ValueError names ``name``."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        try:
            with open(value, "rb") as f:
                value = f.read(1 << 20)  # a certificate chain is kilobytes; a device is not one
        except OSError as exc:
            raise ValueError(f"{name}: cannot read {os.fspath(value)}: {exc.strerror}") from None
    data = value.encode() if isinstance(value, str) else bytes(value)
    if b"-----BEGIN " not in data:
        raise ValueError(f"{name} is not PEM (no '-----BEGIN' line)")
    return data
