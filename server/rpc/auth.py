"""Who may call what (docs/design.md §6.1): bearer tokens with roles and scopes (TLS and the
binding rule: server/rpc/tls.py).

Tokens carry one of three roles, each including the ones before it::

    read  < train < admin

and a fourth, ``peer``, apart from them: the servers' own credential for server-to-server calls
(replicas, docs/design.md §6.1). Only ``peer`` may call ``StoreReplica``, and ``peer`` may call
nothing else but the shared-segment calls (``PEER_SEGMENTS``, for replicas to a neighbour on
the same host): an admin token does not store replicas, a server's token does not train. Every
server of a cluster lists the same ``peer`` token, and trainers never hold it. A server sends its
replicas with a credential derived from that token for the one job (``peer_credentials``), never
the token itself; the receiver grants ``peer`` scoped to exactly that job.

``METHOD_ROLES`` maps every method of the Shard service to the role it needs; a method missing
from it (a new RPC: Snapshot*, Restore*, Replica*, Shutdown*, ...) needs ``admin`` until someone
lists it. The standard health and reflection services stay open, so probes and ``grpcurl``
work without a token; every other service needs ``admin``.

A call without a token, or with an unknown one, fails with UNAUTHENTICATED; a known token without
the role fails with PERMISSION_DENIED. Both happen before the request is even parsed, so a
rejected call never changes the server.

A token may also be scoped to jobs and runs (``train TOKEN jobs=team-a-*``,
server/rpc/scopes.py): its calls naming another job or run fail with PERMISSION_DENIED, decided
from the request's bytes before it is parsed; a session's calls are checked one by one
(server/transport/sessions.py), and Status and listings show only what is in scope
(server/servicer.py). ``peer`` tokens take no scope; the credentials derived from them have one job.

Under mutual TLS, ``peer`` may also come from the caller's verified client certificate: a server
given ``peer_identities`` (``paramshard serve --peer-identity NAME``) grants ``peer``, and only
``peer``, to a caller whose certificate's subject common name or a DNS subject alternative name
is one of them, with no token. Servers present their own certificate to each other, so a
cluster whose servers share a CA and an identity needs no peer token. A token's role applies as
before; an identity never adds to it.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from paramshard.protos.service import SERVICE_NAME
from paramshard.server.rpc import peer_credentials
from paramshard.server.rpc.scopes import (
    ROUTES,
    Grant,
    Scope,
    scope_checked,
)
from paramshard.server.rpc.scopes import refusal as scope_refusal
from paramshard.server.rpc.tokens import LADDER, PEER, check_tokens, grant_of

__all__ = [
    "SERVICE_NAME",
    "bearer",
    "caller_id",
    "caller_of",
    "METHOD_ROLES",
    "OPEN_SERVICES",
    "TokenAuthInterceptor",
    "required_role",
    "role_allows",
    "PEER_SEGMENTS",
    "certificate_names",
]


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
    "ContributeRead": "train",
    "Lease": "train",
    "HoldLease": "train",
    "Join": "train",
    # admin: destroys, writes, replaces or sends away state
    "ConfigureReplication": "admin",  # makes the server send its slices to another server
    "DropJob": "admin",
    "Snapshot": "admin",
    "CommitSnapshot": "admin",
    "DeleteSnapshot": "admin",
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


def _needs(role: str) -> str:
    """How a message names what a method needs."""
    if role == PEER:
        return "a bearer token with role 'peer' (the servers' own)"
    return f"a bearer token with role '{role}' or above"


# --------------------------------------------------------------------------------- interceptor
def bearer(metadata: Any) -> str | None:
    """The token of an ``authorization: Bearer TOKEN`` header; "" when the header is malformed."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def caller_id(metadata: Any) -> str | None:
    """Who a call is, for what belongs to its caller (shared segments, fair shares): its bearer
    token, or one owner for every server's derived peer credential, which changes from call
    to call (server/rpc/peer_credentials.py)."""
    token = bearer(metadata)
    if token and peer_credentials.is_derived(token):
        return peer_credentials.OWNER
    return token


def caller_of(context: Any) -> str | None:
    """``caller_id`` of a call's context; None for a call without a token, or one made in this
    process (its context has no metadata: client/local_calls.py)."""
    metadata = getattr(context, "invocation_metadata", None)
    return (caller_id(metadata()) if metadata is not None else None) or None


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
    """Checks the bearer token of every call against ``tokens`` ({token: role or Grant}), and
    a scoped token's calls against its scope; with ``peer_identities``, a client certificate
    naming one of them has role ``peer``."""

    def __init__(self, tokens: Mapping[str, str | Grant], peer_identities: Any = ()) -> None:
        checked = check_tokens(tokens)
        self.identities = frozenset(peer_identities)
        if not checked and not self.identities:
            raise ValueError("TokenAuthInterceptor needs at least one token or peer identity")
        self._tokens = [(t.encode(), grant_of(g)) for t, g in checked.items()]
        self._peer_tokens = [t for t, g in checked.items() if grant_of(g).role == PEER]

    def grant(self, token: str) -> Grant | None:
        if peer_credentials.is_derived(token):
            return self._derived(token)[0]
        presented = token.encode("utf-8", "replace")
        found = None
        for known, grant in self._tokens:  # no early exit: the time does not depend on the match
            if hmac.compare_digest(known, presented):
                found = grant
        return found

    def _derived(self, credential: str) -> tuple[Grant | None, str]:
        """A server's derived peer credential: the peer role for its one job, or why not."""
        if not self._peer_tokens:
            return None, "a peer credential, and this server has no peer token"
        job, why = peer_credentials.verify(self._peer_tokens, credential)
        if job is None:
            return None, why
        return Grant(PEER, Scope(jobs=(job,), runs=(), exact=True)), ""

    def role_of(self, token: str) -> str | None:
        grant = self.grant(token)
        return None if grant is None else grant.role

    def caller_role(self, metadata: Any) -> str | None:
        """The role of the token in ``metadata``; None without a known one."""
        token = bearer(metadata)
        return self.role_of(token) if token else None

    def caller_scope(self, metadata: Any) -> Scope | None:
        """The scope of the token in ``metadata``; None when it is unscoped (or unknown: such a
        call never reaches a handler)."""
        token = bearer(metadata)
        grant = self.grant(token) if token else None
        return None if grant is None else grant.scope

    def context_scope(self, context: Any) -> Scope | None:
        """``caller_scope`` of a handler's ``context`` (a session call's context too)."""
        return self.caller_scope(context.invocation_metadata())

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
        grant = self.grant(token) if token else None
        refusal = self._refusal(name, need, token, grant)
        if refusal is None:
            return self._scoped(handler, name, grant)
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

    @staticmethod
    def _scoped(
        handler: grpc.RpcMethodHandler, name: str, grant: Grant | None
    ) -> grpc.RpcMethodHandler:
        """``handler`` for a caller whose role suffices: as it is for an unscoped token, behind
        the scope check for a scoped one (server/rpc/scopes.py)."""
        if grant is None or grant.scope is None:
            return handler
        route = ROUTES.get(name)
        if route is None:  # a method nobody routed yet: scoped tokens may not call it
            return _reject(handler, *scope_refusal(grant.scope, name, b""))
        if not route.checked:  # names nothing: Status and listings filter, segments are own
            return handler  # (a session checks each call it carries)
        return scope_checked(handler, grant.scope, name)

    def _refusal(
        self, name: str, need: str, token: str | None, grant: Grant | None
    ) -> tuple[Any, str] | None:
        """Why the token does not let the call through (code, message), or None if it does."""
        if not token:
            how = "is missing" if token is None else "is not 'Bearer TOKEN'"
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                f"{name}: this server requires {_needs(need)}; the 'authorization' metadata {how}",
            )
        if grant is None:
            what = "unknown bearer token"
            if peer_credentials.is_derived(token):
                what = self._derived(token)[1]
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                f"{name}: {what}; this call needs {_needs(need)}",
            )
        if not role_allows(grant.role, need, name):
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"{name} needs role '{need}'; this token has role '{grant.role}'",
            )
        return None
