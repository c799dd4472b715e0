"""``ClusterSpec``: where the shard servers are and how to reach them (like torchrun's env)."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import grpc

from paramshard.client.chunk_size import MAX_REPLY_BYTES
from paramshard.protos import closing
from paramshard.protos.hosts import is_loopback

__all__ = ["ClusterSpec", "CHANNEL_OPTIONS"]

# docs/design.md §7.5: the 4 MiB default rejects pulls and pushes; nothing else made a difference.
# Replies are bounded all the same (MAX_REPLY_BYTES): a chunk's, with room, or a large Status.
# Reconnection backs off at most 5 s (grpc's default grows to 120 s): after a link cut every
# rank is back within about 6 s, before a server takes a late one for lost
# (server/collectives/leases.py). The first wait stays grpc's 1 s: a dead server then fails every
# retry of a call at once, instead of some of a collective's calls reaching its empty restart and
# waiting there. Each channel keeps its own connections (grpc shares them between channels to one
# address by default): a channel left to a stopped server, backing off, must not fail the calls of a
# new client whose server got the same port (seen in CI as "Connection refused" from a live server).
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
    ("grpc.max_reconnect_backoff_ms", 5000),
    ("grpc.use_local_subchannel_pool", 1),
]
# Channels are made on first use from any rank's thread and closed from another (a harness
# closing clients while a rank still runs): one lock for all specs, as channels are made rarely.
_CHANNELS_LOCK = threading.Lock()


class _Channels:
    """A spec's channels, one per address, shared with its subsets, and how many clients
    hold them (``ClusterSpec.hold``)."""

    def __init__(self) -> None:
        self.by_address: dict[str, grpc.Channel] = {}
        self.holders = 0


@dataclass
class ClusterSpec:
    """Addresses of the N shard servers, index 0..N-1, and the credentials to reach them."""

    addresses: Sequence[str]
    """``host:port`` of each server; server i holds slice i of every buffer."""
    token: str | None = None
    """Bearer token sent with every call (servers listening beyond loopback require one or TLS)."""
    tls_ca: bytes | None = None
    """PEM root certificate(s) to verify the servers; setting it switches channels to TLS."""
    tls_cert: bytes | None = None
    """PEM client certificate, for servers that require mutual TLS (TLS with the system's root
    certificates when ``tls_ca`` is not given)."""
    tls_key: bytes | None = None
    """PEM private key of ``tls_cert``."""
    tls_server_name: str | None = None
    """Override of the name checked against the server certificate."""
    _channels: _Channels = field(default_factory=_Channels, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.addresses = [a.strip() for a in self.addresses if a and a.strip()]
        if not self.addresses:
            raise ValueError("ClusterSpec needs at least one server address (host:port)")
        for a in self.addresses:
            _check_address(a)
        if self.token is not None:
            self.token = self.token.strip() or None  # read from a file: no trailing newline
            if self.token is not None and (
                not self.token.isascii() or any(c.isspace() for c in self.token)
            ):
                raise ValueError("the token has whitespace or non-ASCII characters")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together (mutual TLS needs both)")
        for name in ("tls_ca", "tls_cert", "tls_key"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, value.encode())

    @property
    def tls(self) -> bool:
        """Whether channels use TLS (a CA or a client certificate is set)."""
        return self.tls_ca is not None or self.tls_cert is not None

    @classmethod
    def from_env(cls) -> ClusterSpec:
        """Reads ``PARAMSHARD_SERVERS=host:port,...`` (and ``PARAMSHARD_TOKEN``,
        ``PARAMSHARD_TLS_CA/CERT/KEY`` file paths, ``PARAMSHARD_TLS_SERVER_NAME``) as set by
        ``paramshard launch``."""
        servers = os.environ.get("PARAMSHARD_SERVERS", "")
        if not servers.strip():
            raise ValueError(
                "PARAMSHARD_SERVERS is not set: export PARAMSHARD_SERVERS=host:port,host:port,..."
                " (paramshard launch sets it), or build ClusterSpec([...]) yourself"
            )

        def read(var: str) -> bytes | None:
            path = os.environ.get(var)
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()

        return cls(
            servers.split(","),
            token=os.environ.get("PARAMSHARD_TOKEN") or None,
            tls_ca=read("PARAMSHARD_TLS_CA"),
            tls_cert=read("PARAMSHARD_TLS_CERT"),
            tls_key=read("PARAMSHARD_TLS_KEY"),
            tls_server_name=os.environ.get("PARAMSHARD_TLS_SERVER_NAME") or None,
        )

    def __len__(self) -> int:
        return len(self.addresses)

    @property
    def servers_per_host(self) -> int:
        """The most servers whose addresses name one host (every loopback name is one host):
        the servers a trainer of the fullest host may share memory with, as far as the
        addresses tell. Every rank of a job has the same addresses, so all agree."""
        return max(Counter(_host_of(a) for a in self.addresses).values())

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def subset(self, indices: Sequence[int]) -> ClusterSpec:
        """The servers ``indices`` of this spec (in that order) as a spec of their own, with
        the same credentials and sharing this spec's channels: server i of the subset is
        server ``indices[i]`` here. A group of ranks uses its members' servers this way."""
        for i in indices:
            if not 0 <= i < len(self.addresses):
                raise ValueError(f"server {i} is outside 0..{len(self.addresses) - 1}")
        view = replace(self, addresses=[self.addresses[i] for i in indices])
        view._channels = self._channels
        return view

    def detached(self) -> ClusterSpec:
        """The same servers and credentials with channels of its own, which its ``close``
        closes: for calls after this spec's clients let theirs go (a rank's exit)."""
        view = replace(self)
        view._channels = _Channels()
        return view

    def channel(self, index: int) -> grpc.Channel:
        """A channel to server ``index`` (one per address, shared by all calls of this spec
        and of its subsets)."""
        address = self.addresses[index]
        with _CHANNELS_LOCK:
            chan = self._channels.by_address.get(address)
            if chan is None:
                chan = self._channels.by_address[address] = self._open(address)
        return chan

    def _open(self, address: str) -> grpc.Channel:
        options = list(CHANNEL_OPTIONS)
        if not self.tls:
            return grpc.insecure_channel(address, options=options)
        creds = grpc.ssl_channel_credentials(self.tls_ca, self.tls_key, self.tls_cert)
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return grpc.secure_channel(address, creds, options=options)

    def hold(self) -> None:
        """A client uses this spec's channels until it calls ``release`` (``ShardClient`` does
        both): several clients may share one spec, as the ranks of a test or a benchmark in one
        process do."""
        with _CHANNELS_LOCK:
            self._channels.holders += 1

    def release(self) -> None:
        """A client is done with the channels: they close once no client holds them, so one
        rank closing its client does not close the channels under another's calls."""
        with _CHANNELS_LOCK:
            self._channels.holders = max(0, self._channels.holders - 1)
            if self._channels.holders:
                return
        self.close()

    def close(self) -> None:
        """Closes the channels now, whoever holds them (a client calling later opens new
        ones)."""
        with _CHANNELS_LOCK:
            channels = list(self._channels.by_address.values())
            self._channels.by_address.clear()
        for chan in channels:
            _close_bounded(chan)


def _close_bounded(chan: grpc.Channel) -> None:
    """Closes ``chan``, waiting at most ``closing.STEP_S``: gRPC's close waits until the
    channel's polling thread has drained every call, which an interrupted call may prevent
    for ever (protos/closing.py). Past the bound the close is left to a daemon thread."""
    closing.bounded(chan.close, "closing a gRPC channel")


def _host_of(address: str) -> str:
    """The host part of ``host:port`` (``[v6]:port`` too), one name for every loopback one and
    for 0.0.0.0 (which a client reaches on its own host)."""
    host = address.rsplit(":", 1)[0].strip("[]").lower()
    return "loopback" if host == "0.0.0.0" or is_loopback(host) else host


def _check_address(address: str) -> None:
    """``address`` is ``host:port`` (``[v6]:port`` for an IPv6 host) with a port of 1..65535:
    gRPC takes any number after the colon modulo 65536, so ``host:99999`` reached port 34463
    and answered as if it were the server named, and ``host:`` went to port 443."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or host == "[]":
        raise ValueError(f"server address {address!r} is not host:port")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"server address {address!r}: the port must be 1..65535, not {port!r}")
