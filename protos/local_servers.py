"""Shard servers running in this process, by address: the registry of the in-process fast path.

A server started in the trainer's own process (tests, notebooks, ``LocalCluster``, a trainer
that hosts its rank's server) registers here; a client whose call goes to that address runs it
in the process instead of through gRPC (client/rpc.py). Both sides import only this module:
the client never imports ``server``, and the server need not know who calls it.

``device`` is where the server's arrays live (``server.backend.device``: "cpu" or
"cuda:N"). A payload already on that device may be handed over as a DLPack-capable object
(``__dlpack__``) instead of bytes, and a pull may ask for its values as such an object, so the
slice moves device to device with no host copy (docs/design.md §7.4).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["LocalServer", "register", "unregister", "lookup", "addresses"]


@dataclass(frozen=True)
class LocalServer:
    """What a client needs of a server in its process."""

    call: Callable[..., Any]
    """``call(method, request, context, device_reply=False)``: runs a data-plane call as its
    gRPC handler would, failing through ``context.abort(code, details)``; with
    ``device_reply`` a PullParams reply carries its values as a device array, not bytes."""
    methods: frozenset[str]
    """The methods ``call`` runs (the data plane: pushes, pulls, slots; and a step's grad
    check and step)."""
    max_receive_bytes: int
    """Larger requests go through gRPC, which refuses them with its own message."""
    device: str
    """Where the server's arrays live: "cpu" or "cuda:N"."""


_servers: dict[str, LocalServer] = {}
_lock = threading.Lock()


def register(address: str, server: LocalServer) -> None:
    """Makes the server at ``address`` (host:port as clients write it) reachable in-process."""
    with _lock:
        _servers[address] = server


def unregister(address: str, server: LocalServer) -> None:
    """Removes ``server`` from ``address`` (not another server registered there since)."""
    with _lock:
        if _servers.get(address) is server:
            del _servers[address]


def lookup(address: str) -> LocalServer | None:
    """The in-process server at ``address``, or None (the call goes through gRPC)."""
    return _servers.get(address)


def addresses() -> set[str]:
    """The addresses of every in-process server."""
    with _lock:
        return set(_servers)
