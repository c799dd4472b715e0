"""TLS credentials and the binding rule (docs/design.md §6.1, docs/security.md).

A shard server holds the whole model's slice: whoever reaches its port can read or overwrite it.
So a server listens on loopback only, unless it has TLS or tokens (server/rpc/auth.py), or is
told ``insecure``.
"""

from __future__ import annotations

import grpc

from paramshard.protos.hosts import is_loopback

__all__ = ["server_credentials", "peer_channel_credentials", "check_binding"]


def _pem(value: bytes | str | None) -> bytes | None:
    if value is None:
        return None
    return value.encode() if isinstance(value, str) else bytes(value)


def server_credentials(
    cert: bytes | str | None, key: bytes | str | None, ca: bytes | str | None
) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM: ``cert``+``key`` serve TLS; ``ca`` also requires client
    certificates signed by it (mutual TLS). None when none is given."""
    cert, key, ca = _pem(cert), _pem(key), _pem(ca)
    if cert is None and key is None and ca is None:
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both a certificate (tls_cert) and its private key (tls_key)")
    for name, value in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)):
        if value is not None and b"-----BEGIN " not in value:
            raise ValueError(f"{name} is not PEM (no '-----BEGIN' line)")
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def peer_channel_credentials(
    cert: bytes | str | None,
    key: bytes | str | None,
    ca: bytes | str | None,
    peer_ca: bytes | str | None = None,
) -> grpc.ChannelCredentials:
    """TLS for this server's calls to the other servers (replicas): their certificates are
    checked against ``peer_ca`` (default ``ca``, else the system's roots); with mutual TLS
    (``ca``) this server presents its own ``cert``."""
    cert, key, ca, peer_ca = _pem(cert), _pem(key), _pem(ca), _pem(peer_ca)
    mutual = ca is not None and cert is not None and key is not None
    return grpc.ssl_channel_credentials(
        root_certificates=peer_ca or ca,
        private_key=key if mutual else None,
        certificate_chain=cert if mutual else None,
    )


def check_binding(host: str, *, tls: bool, tokens: bool, insecure: bool) -> bool:
    """Raises ValueError for a non-loopback ``host`` without TLS or tokens unless ``insecure``.

    Returns whether the server will be reachable beyond this host with no protection at all."""
    if is_loopback(host) or tls or tokens:
        return False
    if not insecure:
        raise ValueError(
            f"refusing to listen on {host or 'all interfaces'!r} without TLS or tokens: a shard"
            " server holds the whole model, and whoever can reach the port can read or overwrite"
            " it. Give TLS (tls_cert and tls_key, and tls_ca for mutual TLS) or tokens, keep"
            " 127.0.0.1 (and tunnel, e.g. ssh -L), or set insecure on a network you trust"
        )
    return True
