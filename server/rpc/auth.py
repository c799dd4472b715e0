"""Who may call what (DESIGN section 6): TLS credentials, bearer tokens with roles, binding rule.

A shard server holds the whole model's slice: whoever reaches its port can read or overwrite it.
So a server listens on loopback only, unless it has TLS or tokens, or is told ``insecure``.

Tokens carry one of three roles, each including the ones before it::

    read  < train < admin

and a fourth, ``peer``, apart from them: the servers' own credential for server-to-server calls
(replicas, DESIGN section 6). Only ``peer`` may call ``StoreReplica``, and ``peer`` may call
nothing else but the shared-segment calls (``PEER_SEGMENTS``, for replicas to a neighbour on
the same host): an admin token does not store replicas, a server's token does not train. A server
sends replicas with the ``peer`` token of its own token file (``peer_token``), so every server of a
cluster lists the same one, and trainers never hold it.

``METHOD_ROLES`` maps every method of the Shard service to the role it needs; a method missing
from it (a new RPC: Snapshot*, Restore*, Replica*, Shutdown*, ...) needs ``admin`` until someone
lists it. The standard health and reflection services stay open, so probes and ``grpcurl``
work without a token; every other service needs ``admin``.

A call without a token, or with an unknown one, fails with UNAUTHENTICATED; a known token without
the role fails with PERMISSION_DENIED. Both happen before the request is even parsed, so a
rejected call never changes the server.

Under mutual TLS, ``peer`` may also come from the caller's verified client certificate: a server
given ``peer_identities`` (``paramshard serve --peer-identity NAME``) grants ``peer``, and only
``peer``, to a caller whose certificate's subject common name or a DNS subject alternative name
is one of them, with no token. Servers present their own certificate to each other, so a
cluster whose servers share a CA and an identity needs no peer token. A token's role applies as
before; an identity never adds to it.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from paramshard.protos import shard_pb2 as pb

__all__ = [
    "SERVICE_NAME",
    "ROLES",
    "bearer",
    "METHOD_ROLES",
    "OPEN_SERVICES",
    "TokenAuthInterceptor",
    "required_role",
    "role_allows",
    "PEER_SEGMENTS",
    "peer_token",
    "check_tokens",
    "parse_token_file",
    "load_token_file",
    "server_credentials",
    "peer_channel_credentials",
    "is_loopback",
    "check_binding",
    "certificate_names",
]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Shard"].full_name  # "paramshard.v1.Shard"

LADDER = ("read", "train", "admin")
"""From least to most: a token's role includes every role before it."""
PEER = "peer"
ROLES = (*LADDER, PEER)
"""Every role a token may have: the ladder, and ``peer`` (servers only) apart from it."""
_RANK = {role: i for i, role in enumerate(LADDER)}

METHOD_ROLES: dict[str, str] = {
    # read: look, never touch (status, inspect, get, export)
    "Status": "read",
    "PullParams": "read",  # trainers pull too, but so do inspect/get/export
    "ListSnapshots": "read",
    "ListReplicas": "read",
    "OfferSegment": "read",  # shared memory for pulls too; segments belong to the token
    "ConfirmSegment": "read",
    "ReleaseSegments": "read",
    # each call a session carries needs its own method's role (server/transport/sessions.py)
    "Session": "read",
    # train: everything a training step does, collectives included
    "RegisterBuffer": "train",
    "SetParams": "train",
    "PushGrad": "train",
    "GradNorm": "train",
    "Step": "train",
    "Contribute": "train",
    "ReadSlot": "train",
    "Lease": "train",
    "HoldLease": "train",
    # admin: destroys, writes, replaces or sends away state
    "ConfigureReplication": "admin",  # makes the server send its slices to another server
    "DropJob": "admin",
    "Snapshot": "admin",
    "CommitSnapshot": "admin",
    "Restore": "admin",
    "FetchReplica": "admin",
    "LoadReplica": "admin",
    "RollbackToReplica": "admin",
    # peer: server to server only, with the servers' own token
    "StoreReplica": PEER,
}
"""Role needed by each method of the Shard service; any method not listed needs ``DEFAULT_ROLE``
(Snapshot*, Restore*, Replica*, Shutdown* are admin through this default)."""
DEFAULT_ROLE = "admin"

OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)
"""Services anyone may call: liveness probes and schema discovery reveal nothing of the model."""


def required_role(full_method: str) -> str | None:
    """The role ``/service/Method`` needs, or None for an open service."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    if service in OPEN_SERVICES:
        return None
    if service == SERVICE_NAME:
        return METHOD_ROLES.get(method, DEFAULT_ROLE)
    return DEFAULT_ROLE


PEER_SEGMENTS = frozenset({"OfferSegment", "ConfirmSegment", "ReleaseSegments"})
"""The ``read`` methods ``peer`` may call too: a server hands its neighbour replicas through
shared memory when both run on one host (server/replication/neighbour_shm.py)."""


def role_allows(have: str, need: str, method: str = "") -> bool:
    """Whether a token of role ``have`` may call ``method``, which needs ``need``: up the
    ladder read < train < admin; ``peer`` only for ``peer`` and ``PEER_SEGMENTS``."""
    if have == PEER and method in PEER_SEGMENTS:
        return True
    if PEER in (have, need):
        return have == need
    return _RANK[have] >= _RANK[need]


def peer_token(tokens: Mapping[str, str]) -> str | None:
    """The token this server sends to its peers (the first ``peer`` line), None without one."""
    return next((t for t, role in tokens.items() if role == PEER), None)


def _needs(role: str) -> str:
    """How a message names what a method needs."""
    if role == PEER:
        return "a bearer token with role 'peer' (the servers' own)"
    return f"a bearer token with role '{role}' or above"


def check_tokens(tokens: Mapping[str, str]) -> dict[str, str]:
    """Validates ``{token: role}``: known roles, tokens usable as gRPC metadata."""
    out = {}
    for token, role in tokens.items():
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
        if not isinstance(token, str) or not token:
            raise ValueError("a token must be a non-empty string")
        if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
            raise ValueError(
                f"a token of role {role!r} has whitespace or non-printable / non-ASCII characters"
                " (it travels as an 'authorization: Bearer TOKEN' header)"
            )
        out[token] = role
    return out


def parse_token_file(text: str, source: str = "token file") -> dict[str, str]:
    """``ROLE TOKEN`` per line (roles read, train, admin, peer); blank lines and lines
    starting with ``#`` are skipped."""
    tokens: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"{source} line {number}"
        if len(parts) != 2:
            raise ValueError(f"{where}: expected 'ROLE TOKEN', got {len(parts)} fields")
        role, token = parts
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r} (roles: {', '.join(ROLES)})")
        if token in tokens and tokens[token] != role:
            raise ValueError(
                f"{where}: the same token is listed with roles {tokens[token]!r} and {role!r}"
            )
        try:
            tokens.update(check_tokens({token: role}))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if not tokens:
        raise ValueError(f"{source} has no tokens (expected lines 'ROLE TOKEN')")
    return tokens


def load_token_file(path: str) -> dict[str, str]:
    with open(path, encoding="utf-8") as f:
        return parse_token_file(f.read(), path)


def token_file_is_private(path: str) -> bool:
    """False when group or others may read the file (worth a warning)."""
    try:
        return os.stat(path).st_mode & 0o077 == 0
    except OSError:
        return True


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


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost, or "" (all interfaces)
        return False


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


# --------------------------------------------------------------------------------- interceptor
def bearer(metadata: Any) -> str | None:
    """The token of an ``authorization: Bearer TOKEN`` header; "" when the header is malformed."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def _reject(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> Any:
    """A handler of the same shape as ``handler`` that fails at once, never parsing the request."""

    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    def ignore(_raw: bytes) -> bool:
        return True  # not None: grpcio takes a None request for a deserialisation failure

    streaming_in, streaming_out = handler.request_streaming, handler.response_streaming
    make: Callable[..., grpc.RpcMethodHandler] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(streaming_in, streaming_out)]
    return make(abort, request_deserializer=ignore)


def certificate_names(context: grpc.ServicerContext) -> set[str]:
    """The subject common name and DNS alternative names of the caller's verified client
    certificate (empty without mutual TLS)."""
    found = context.auth_context() or {}
    names = [*found.get("x509_common_name", ()), *found.get("x509_subject_alternative_name", ())]
    return {n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names}


def _identity_checked(
    handler: grpc.RpcMethodHandler, identities: frozenset[str], refusal: tuple[Any, str]
) -> grpc.RpcMethodHandler:
    """``handler`` behind a check of the caller's certificate (only a handler sees it, not an
    interceptor): a certificate naming one of ``identities`` runs it, any other caller gets
    ``refusal`` (code, message). The request is parsed only after the check passed."""
    parse, behave = handler.request_deserializer, handler.unary_unary
    code, message = refusal

    def checked(raw: bytes, context: grpc.ServicerContext) -> Any:
        if not certificate_names(context) & identities:
            context.abort(code, message)
        return behave(parse(raw) if parse else raw, context)

    return grpc.unary_unary_rpc_method_handler(
        checked, request_deserializer=None, response_serializer=handler.response_serializer
    )


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Checks the bearer token of every call against ``tokens`` ({token: role}); with
    ``peer_identities``, a client certificate naming one of them has role ``peer``."""

    def __init__(self, tokens: Mapping[str, str], peer_identities: Any = ()) -> None:
        checked = check_tokens(tokens)
        self.identities = frozenset(peer_identities)
        if not checked and not self.identities:
            raise ValueError("TokenAuthInterceptor needs at least one token or peer identity")
        self._tokens = [(t.encode(), role) for t, role in checked.items()]

    def role_of(self, token: str) -> str | None:
        presented = token.encode("utf-8", "replace")
        found = None
        for known, role in self._tokens:  # no early exit: the time does not depend on the match
            if hmac.compare_digest(known, presented):
                found = role
        return found

    def caller_role(self, metadata: Any) -> str | None:
        """The role of the token in ``metadata``; None without a known one."""
        token = bearer(metadata)
        return self.role_of(token) if token else None

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        need = required_role(method)
        if need is None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED: the method list is public anyway (reflection)
        name = method.rsplit("/", 1)[-1]
        token = bearer(handler_call_details.invocation_metadata)
        refusal = self._refusal(name, need, token)
        if refusal is None:
            return handler
        if need == PEER and self.identities and not handler.request_streaming:
            code, message = refusal
            return _identity_checked(
                handler,
                self.identities,
                (
                    code,
                    f"{message}, or a client certificate naming"
                    f" one of the servers' peer identities",
                ),
            )
        if not self._tokens and need != PEER:
            return handler  # identities only: the other methods stay as open as without tokens
        return _reject(handler, *refusal)

    def _refusal(self, name: str, need: str, token: str | None) -> tuple[Any, str] | None:
        """Why the token does not let the call through (code, message), or None if it does."""
        if not token:
            how = "is missing" if token is None else "is not 'Bearer TOKEN'"
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                f"{name}: this server requires {_needs(need)}; the 'authorization' metadata {how}",
            )
        have = self.role_of(token)
        if have is None:
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                f"{name}: unknown bearer token; this call needs {_needs(need)}",
            )
        if not role_allows(have, need, name):
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"{name} needs role '{need}'; this token has role '{have}'",
            )
        return None
