"""Why a call did not reach its server, in words: grpc says ``UNAVAILABLE: failed to connect to
all addresses; last error: UNKNOWN: ipv4:...: Tls handshake failed (TSI_PROTOCOL_FAILURE):
SSL_ERROR_SSL: ...`` for a dozen different mistakes. ``cause`` picks the one a user can act on
(nothing listens there, something that does not speak gRPC does, the name does not resolve, TLS
on one side only, the wrong CA, a certificate for another name, a refused token, a call the
server's gRPC dropped unrun); ``RpcCore``, ``paramshard launch --servers`` and ``paramshard
health`` put it into their errors, beside grpc's own words."""

from __future__ import annotations

import grpc

__all__ = ["DROPPED", "cause", "explain", "lacks_role"]

DROPPED = "the server dropped the call before any of its threads took it up"
"""What a rank's error says of a call gRPC's core ended with a bare CANCELLED "CANCELLED": no
handler ran it (client/retries.py asks again, as of a busy server's refusal)."""

_DNS = ("dns resolution failed", "errors resolving", "domain name not found")
# While connecting ("failed to connect to all addresses; last error: ..."): (words grpc uses,
# what they mean), the most specific first; matched case-insensitively
_CAUSES = (
    ("connection refused", "connection refused: nothing listens on that port (is `paramshard"
     " serve` running there, on that port?)"),
    ("wrong_version_number", "TLS handshake failed: the server does not speak TLS (it runs"
     " without --tls-cert; do not set PARAMSHARD_TLS_CA for it)"),
    ("hostname verification", "TLS handshake failed: the server's certificate does not name"
     " this address (set PARAMSHARD_TLS_SERVER_NAME to a name it has)"),
    ("certificate_verify_failed", "TLS handshake failed: the server's certificate is not"
     " signed by the CA given (PARAMSHARD_TLS_CA)"),
    ("certificate signature failure", "TLS handshake failed: the server's certificate is not"
     " signed by the CA given (PARAMSHARD_TLS_CA)"),
    ("handshake failed", "TLS handshake failed"),
    ("socket closed", "the server closed the connection while it was being set up: it requires"
     " TLS (set PARAMSHARD_TLS_CA) or a client certificate (mutual TLS), or it stopped"),
    ("connection reset", "the connection was reset while it was being set up: the server"
     " requires TLS or a client certificate, or it stopped"),
    ("failed parsing http/2", "the port answers, but not in gRPC: something other than a"
     " shard server listens there (a web server, the metrics port?)"),
    ("failed to connect", "cannot connect"),
)  # fmt: skip


def cause(code: grpc.StatusCode, details: str) -> str | None:
    """What kept a call from its server, or None when the failure was not about reaching it."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (
            "the server refused the credentials: check the token (PARAMSHARD_TOKEN,"
            " --token-file) against the server's --token-file"
        )
    if code == grpc.StatusCode.CANCELLED and details == "CANCELLED":
        # gRPC's core's own words: the call ended before the server's handler ran
        return (
            f"{DROPPED}: more calls waited than its --max-pending-calls, or its threads"
            " stalled longer than its --max-wait-s (a machine too busy for it), or it was"
            " stopping"
        )
    if code != grpc.StatusCode.UNAVAILABLE:
        return None
    low = details.lower()
    if any(key in low for key in _DNS):
        return "DNS failure: the host name does not resolve"
    if "failed to connect" not in low:  # not while connecting: a call the server dropped
        return None
    return next((words for key, words in _CAUSES if key in low), None)


def explain(address: str, code: grpc.StatusCode, details: str) -> str:
    """``details`` led by its cause (``cannot reach HOST:PORT: connection refused ...;
    grpc: <details>``); unchanged when no cause is recognised."""
    why = cause(code, details)
    if why is None:
        return details
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"{details} ({why})"
    if code == grpc.StatusCode.CANCELLED:
        return f"{address}: {why}; grpc: {details}"
    return f"cannot reach {address}: {why}; grpc: {details}"


def lacks_role(code: grpc.StatusCode, details: str) -> bool:
    """Whether a call was refused for its token's role (server/rpc/auth.py: "Snapshot needs
    role 'admin'; this token has role 'train'"), not for its scope or its request."""
    return code == grpc.StatusCode.PERMISSION_DENIED and "needs role" in details
