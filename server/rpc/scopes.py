"""Tokens scoped to jobs and runs (docs/security.md): which job or run a call touches, read from
its request's bytes before the request is parsed.

A token line of ``--token-file`` may name the jobs and the runs its holder may touch::

    train tok-a jobs=team-a-*,eval-a runs=team-a-*

A pattern is an exact name, or a prefix ending in ``*`` (``*`` alone: every name). A line that
names only ``jobs=`` uses the same patterns for runs, and the other way round (a team names its
jobs and its runs, ``PARAMSHARD_RUN``, alike); a line that names neither is unscoped and may
touch every job and run, as before scopes existed.

Jobs are the names of buffers' ``BufferRef.job`` and of the job-level calls (Step, Snapshot,
Restore, replicas, ...). Runs are what collectives and leases name: a slot key's run is its
text before the first ``:`` (client/collectives.py writes ``<run>:ar3/0``, a group's
``<run>/<group>:...``, a restart's ``<run>.e2...``), a lease's is ``LeaseRequest.run``. An
exact run pattern ``R`` covers ``R``, its groups ``R/...`` and its epochs ``R.eN...``, as
``DropJob R`` drops them (server/collectives/pending.py ``run_epoch``); so no tenant's run
should begin with another's run and a ``/``.

``ROUTES`` says, for every method of the Shard service, where its request names the job or
run (a path of fields) and what a scoped token may do with it. The check runs before the
request is parsed: ``named`` walks the request's wire bytes along that path only, field
numbers from the descriptor, with protobuf's rules (the last occurrence of a string wins;
occurrences of a message merge), so a request for another job is refused before its payload
is decoded, waited on, or read from a shared segment, and the server does no work for another
job. A header (request metadata naming the job) would have been a second statement of the
same fact that the server would still have had to compare with the payload, and a session
carries many calls on one stream's metadata; the bytes themselves are the one source. After
the parse, ``mismatch`` checks that the parsed request names the same job or run (a second
reading, should the two ever disagree).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb

__all__ = [
    "Scope",
    "Grant",
    "Route",
    "ROUTES",
    "SCOPE_KEYS",
    "parse_scope",
    "run_of_key",
    "named",
    "refusal",
    "mismatch",
    "scope_checked",
]

SCOPE_KEYS = ("jobs", "runs")
"""The ``KEY=PATTERNS`` fields a token line may add after ``ROLE TOKEN``."""
MAX_PATTERNS = 256
"""Patterns per key of one token line."""
MAX_SCANNED_FIELDS = 1 << 16
"""Fields a request of a scoped token may have, at its top level and inside the messages on
the way to its job or run: the walk costs about half a microsecond per field, so a request of
many tiny fields costs tens of milliseconds at most before it is refused (RegisterBuffer has
one field per parameter: a buffer of more parameters than this needs an unscoped token)."""
_EPOCH_HEAD = re.compile(r"\.e\d+(?:/|$)")


def _patterns(key: str, text: str) -> tuple[str, ...]:
    """The comma-separated patterns of ``key=text``, checked."""
    found = tuple(text.split(","))
    if not text or any(not p for p in found):
        raise ValueError(f"{key}= needs comma-separated names or prefixes ending in '*'")
    if len(found) > MAX_PATTERNS:
        raise ValueError(f"{key}= has {len(found)} patterns, at most {MAX_PATTERNS}")
    for p in found:
        if "*" in p[:-1]:
            raise ValueError(f"{key}= pattern {p!r}: '*' may only end a pattern (a prefix)")
        if not p.isprintable() or any(c.isspace() for c in p):
            raise ValueError(f"{key}= pattern {p!r} has whitespace or non-printable characters")
        if key == "runs" and ":" in p:
            raise ValueError(f"runs= pattern {p!r} has ':', which no run id has")
    return found


@dataclass(frozen=True)
class Scope:
    """The jobs and runs a token may touch: exact names, or prefixes ending in ``*``."""

    jobs: tuple[str, ...]
    runs: tuple[str, ...]
    exact: bool = False
    """Names, not patterns: a server's derived peer credential (server/rpc/peer_credentials.py)
    is good for one job, whatever characters its name has."""

    def allows_job(self, job: str) -> bool:
        if self.exact:
            return job in self.jobs
        return any(_matches(p, job) for p in self.jobs)

    def allows_run(self, run: str) -> bool:
        """Whether run ``run`` (a lease's run, a slot key's text before ``:``) is in scope:
        an exact pattern also covers the run's groups and epochs."""
        if self.exact:
            return run in self.runs
        return any(_run_matches(p, run) for p in self.runs)

    def __str__(self) -> str:
        return f"jobs={','.join(self.jobs)} runs={','.join(self.runs)}"


def _matches(pattern: str, name: str) -> bool:
    if pattern.endswith("*"):
        return name.startswith(pattern[:-1])
    return name == pattern


def _run_matches(pattern: str, run: str) -> bool:
    if pattern.endswith("*"):
        return run.startswith(pattern[:-1])
    if not run.startswith(pattern):
        return False
    rest = run[len(pattern) :]
    return not rest or rest.startswith("/") or _EPOCH_HEAD.match(rest) is not None


@dataclass(frozen=True)
class Grant:
    """What a token may do: its role (server/rpc/auth.py), and the jobs and runs it may touch
    (None: every one)."""

    role: str
    scope: Scope | None = None

    def __str__(self) -> str:
        return self.role if self.scope is None else f"{self.role} {self.scope}"


def parse_scope(fields: Iterable[str]) -> Scope | None:
    """The scope of a token line's ``jobs=...`` / ``runs=...`` fields (None without them)."""
    given: dict[str, tuple[str, ...]] = {}
    for item in fields:
        key, sep, text = item.partition("=")
        if not sep or key not in SCOPE_KEYS:
            raise ValueError(f"{item[:64]!r} is not a scope; expected jobs=... or runs=...")
        if key in given:
            raise ValueError(f"{key}= is given twice")
        given[key] = _patterns(key, text)
    if not given:
        return None
    jobs = given.get("jobs", given.get("runs", ()))
    return Scope(jobs=jobs, runs=given.get("runs", jobs))


def run_of_key(key: str) -> str:
    """The run of slot key ``key``: its text before the first ``:`` (all of it without one)."""
    return key.split(":", 1)[0]


# ------------------------------------------------------------------------------------- routes
@dataclass(frozen=True)
class Route:
    """Where a method's request names what it touches, and how a scoped token is checked.

    ``kind``: ``job`` (the named job must be in scope), ``run`` (the named run), ``key`` (the
    run of the named slot key), ``job+run`` (the name must be in scope as a job and as a run:
    DropJob drops both), ``listing`` (a named job must be in scope; none lists only the jobs
    in scope), ``status`` (nothing named; the reply shows only what is in scope), ``own``
    (nothing named; the token's own shared segments), ``calls`` (a session: each call it
    carries is checked as its unary twin). ``path``: the field names down to the name."""

    kind: str
    path: tuple[str, ...] = ()
    rule: str = ""
    """One line for the docs' table."""
    run_path: tuple[str, ...] = ()
    """Where the request also names a run that must be in ``runs=`` when it names one (Join:
    its job, and the run whose leases decide the members; RegisterBuffer: the run whose ranks
    push to the buffer, which a client without peers leaves empty; Restore: the run of the rank
    that asks)."""
    into_path: tuple[str, ...] = ()
    """Where it also names a job it makes, in ``jobs=`` when named (Restore: ``into``)."""

    @property
    def checked(self) -> bool:
        """Whether a request is refused by what it names (else: nothing named, or filtered)."""
        return bool(self.path)


def _job(path: str) -> Route:
    return Route("job", tuple(path.split(".")), f"`{path}` in `jobs=`")


_RESTORE = "`job` in `jobs=`, `into`, when given, in `jobs=`, and `run`, when given, in `runs=`"
ROUTES: dict[str, Route] = {
    "RegisterBuffer": Route(
        "job", ("ref", "job"), "`ref.job` in `jobs=` and `run`, when given, in `runs=`", ("run",)
    ),
    "SetParams": _job("header.ref.job"),
    "PushGrad": _job("header.ref.job"),
    "PullParams": _job("ref.job"),
    "GradNorm": _job("job"),
    "Step": _job("job"),
    "Contribute": Route("key", ("header", "key"), "the run of `header.key` in `runs=`"),
    "ReadSlot": Route("key", ("key",), "the run of `key` in `runs=`"),
    "ContributeRead": Route("key", ("header", "key"), "the run of `header.key` in `runs=`"),
    "Lease": Route("run", ("run",), "`run` in `runs=` (renewals, releases and aborts alike)"),
    "HoldLease": Route("run", ("run",), "`run` in `runs=` (the stream holds the lease, as Lease)"),
    "DropJob": Route("job+run", ("job",), "`job` in `jobs=` and in `runs=`"),
    "Status": Route(
        "status", (), "only jobs in `jobs=`, their memberships, pending work of runs in `runs=`"
    ),
    "Snapshot": _job("job"),
    "CommitSnapshot": _job("job"),
    "DeleteSnapshot": _job("job"),
    "Restore": Route("job", ("job",), _RESTORE, ("run",), ("into",)),
    "ListSnapshots": Route("listing", ("job",), "`job` in `jobs=`; empty: only jobs in `jobs=`"),
    "ConfigureReplication": _job("job"),
    "StoreReplica": Route(
        "job", ("job",), "peer only; a derived peer credential: `job` is its job"
    ),
    "ListReplicas": _job("job"),
    "FetchReplica": _job("job"),
    "LoadReplica": _job("job"),
    "RollbackToReplica": _job("job"),
    "OfferSegment": Route("own", (), "the token's own segments; no job named"),
    "ConfirmSegment": Route("own", (), "the token's own segments; no job named"),
    "ReleaseSegments": Route("own", (), "the token's own segments; no job named"),
    "Session": Route("calls", (), "each call it carries, as its unary method"),
    "Join": Route("job", ("job",), "`job` in `jobs=` and `run` in `runs=`", ("run",)),
}
"""Every method of the Shard service (tests/test_token_scopes.py checks the descriptor): a
method missing here refuses scoped tokens until someone routes it."""


def _numbers(method: str, path: tuple[str, ...]) -> tuple[int, ...]:
    """The field numbers of ``path`` in ``method``'s request type."""
    desc = pb.DESCRIPTOR.services_by_name["Shard"].methods_by_name[method].input_type
    numbers = []
    for name in path:
        f = desc.fields_by_name[name]
        numbers.append(f.number)
        desc = f.message_type
    return tuple(numbers)


_NUMBERS = {m: _numbers(m, r.path) for m, r in ROUTES.items() if r.path}
_RUN_NUMBERS = {m: _numbers(m, r.run_path) for m, r in ROUTES.items() if r.run_path}
_INTO_NUMBERS = {m: _numbers(m, r.into_path) for m, r in ROUTES.items() if r.into_path}


def _last(buf: Any, numbers: tuple[int, ...], budget: list[int]) -> Any:
    """The bytes of the string at field path ``numbers`` in the message ``buf`` as protobuf
    reads them: the last occurrence of the string wins, occurrences of a message on the way
    merge. ``budget``: fields left to look at, over the whole walk. A loop of its own, not
    ``codec.fields``: a generator per field costs ten times as much. Groups (wire types 3
    and 4, which no message here has) are refused."""
    want, pos, end, found = numbers[0], 0, len(buf), None
    while pos < end:
        budget[0] -= 1
        if budget[0] < 0:
            raise codec.DecodeError(f"more than {MAX_SCANNED_FIELDS:,} fields")
        key, pos = codec.read_varint(buf, pos, end)
        wire = key & 7
        if wire == 0:
            _, pos = codec.read_varint(buf, pos, end)
            continue
        if wire == 2:
            length, pos = codec.read_varint(buf, pos, end)
            start, pos = pos, pos + length
            if pos > end:
                raise codec.DecodeError(f"field {key >> 3} claims {length} bytes past the end")
            if key >> 3 == want:  # the wanted field with another wire type: protobuf skips it
                value = buf[start:pos]
                inner = value if len(numbers) == 1 else _last(value, numbers[1:], budget)
                if inner is not None:
                    found = inner
            continue
        if wire not in (1, 5):
            raise codec.DecodeError(f"wire type {wire} of field {key >> 3}")
        pos += 8 if wire == 1 else 4
        if pos > end:
            raise codec.DecodeError(f"truncated fixed-width field {key >> 3}")
    return found


def named(method: str, raw: Any, numbers: tuple[int, ...] | None = None) -> str:
    """The job or run ``method``'s request ``raw`` (wire bytes) names ("" when none), at its
    route's path or at field path ``numbers``; raises ``codec.DecodeError`` for bytes that do
    not parse on the way."""
    numbers = _NUMBERS[method] if numbers is None else numbers
    value = _last(memoryview(raw).cast("B"), numbers, [MAX_SCANNED_FIELDS])
    try:
        return "" if value is None else str(value, "utf-8")
    except UnicodeDecodeError as exc:
        raise codec.DecodeError(f"a name is not UTF-8: {exc.reason}") from None


def _outside(
    scope: Scope, route: Route, name: str, also: str | None = None, into: str | None = None
) -> str | None:
    """Why ``name`` is outside ``scope`` for ``route``, or ``also``, the run a job's route
    names at its ``run_path``, or ``into``, the job it names at its ``into_path`` (None:
    inside)."""
    if route.kind == "key":
        run = run_of_key(name)
        return None if scope.allows_run(run) else f"run '{run}' (of slot key {name[:128]!r})"
    if route.kind == "run":
        return None if scope.allows_run(name) else f"run {name[:128]!r}"
    if route.kind == "listing" and not name:
        return None  # lists only the jobs in scope (ShardServicer.list_snapshots)
    if not scope.allows_job(name):
        return f"job {name[:128]!r}"
    if route.kind == "job+run" and not scope.allows_run(name):
        return f"run {name[:128]!r}"
    if also and not scope.allows_run(also):
        return f"run {also[:128]!r}"
    if into and not scope.allows_job(into):
        return f"job {into[:128]!r}"
    return None


def refusal(scope: Scope, method: str, raw: Any) -> tuple[grpc.StatusCode, str] | None:
    """Why a call of ``method`` with request bytes ``raw`` by a token of ``scope`` is refused
    (code, message), or None when it may run; reads only the fields on the way to the name."""
    route = ROUTES.get(method)
    if route is None:
        return (
            grpc.StatusCode.PERMISSION_DENIED,
            f"{method} has no scope rule (server/rpc/scopes.py ROUTES): a token scoped to"
            f" {scope} may not call it",
        )
    if not route.checked:
        return None
    try:
        name = named(method, raw)
        run = named(method, raw, _RUN_NUMBERS[method]) if route.run_path else None
        into = named(method, raw, _INTO_NUMBERS[method]) if route.into_path else None
    except codec.DecodeError as exc:
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{method}: request does not parse as a {method} message: {exc}",
        )
    what = _outside(scope, route, name, run, into)
    if what is None:
        return None
    return (
        grpc.StatusCode.PERMISSION_DENIED,
        f"{method}: {what} is outside this token's scope ({scope})",
    )


def mismatch(scope: Scope, method: str, request: Any) -> tuple[grpc.StatusCode, str] | None:
    """The parsed ``request`` (a message, or a tensor request's (header, payload)) checked
    again: None when it is in scope, or when it did not parse (the handler refuses that)."""
    route = ROUTES.get(method)
    if route is None or not route.checked:
        return None
    path = route.path
    if isinstance(request, tuple):  # a tensor request, parsed as (header, payload view)
        request, path = request[0], path[1:]
    if not hasattr(request, "DESCRIPTOR"):
        return None  # Malformed: INVALID_ARGUMENT follows
    run = _field_at(request, route.run_path) if route.run_path else None
    into = _field_at(request, route.into_path) if route.into_path else None
    what = _outside(scope, route, _field_at(request, path), run, into)
    if what is None:
        return None
    return (
        grpc.StatusCode.PERMISSION_DENIED,
        f"{method}: {what} is outside this token's scope ({scope}) (as parsed)",
    )


def _field_at(message: Any, path: tuple[str, ...]) -> Any:
    """The field of parsed ``message`` at ``path`` (field names)."""
    for name in path:
        message = getattr(message, name)
    return message


def scope_checked(
    handler: grpc.RpcMethodHandler, scope: Scope, method: str
) -> grpc.RpcMethodHandler:
    """``handler`` (a unary request; a unary or streamed reply) behind ``scope``'s check of
    what its request names: the request is parsed only once the check passed, and run only if
    the parsed request agrees."""
    parse: Callable[[bytes], Any] | None = handler.request_deserializer
    streams = handler.response_streaming
    behave = handler.unary_stream if streams else handler.unary_unary
    make = grpc.unary_stream_rpc_method_handler if streams else grpc.unary_unary_rpc_method_handler

    def checked(raw: bytes, context: grpc.ServicerContext) -> Any:
        refused = refusal(scope, method, raw)
        if refused is not None:
            context.abort(*refused)
        request = parse(raw) if parse else raw
        refused = mismatch(scope, method, request)
        if refused is not None:
            context.abort(*refused)
        return behave(request, context)

    return make(checked, request_deserializer=None, response_serializer=handler.response_serializer)
