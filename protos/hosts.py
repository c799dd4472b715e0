"""Which host names mean this host: the one rule that the server's binding check
(server/rpc/tls.py) and the client's count of servers a host (client/cluster.py) share."""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback"]


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost, or "" (all interfaces)
        return False
