"""Issues 13 and 27, chaos suite, fuzz part: fuzzed requests over every method with random roles
and scopes.

A real ``paramshard serve`` process (tests/chaos_target.py) with a token file on 127.0.0.1:0
holds a legit job, ``guarded`` (two buffers, Adam and SGD-momentum state, version 2, a
committed snapshot ``baseline``), and two decoy jobs. Then ``PARAMSHARD_CHAOS_REQUESTS``
(default 10,000) requests made by tests/chaos_requests.py (from the templates of
tests/chaos_templates.py) go to every method of the Shard service (enumerated from
protos/shard_pb2.py, so a new method is covered at once) and of the open health and
reflection services, in batches, several calls in flight, each with a random
caller: no token, an unknown token, a malformed header, a read, train, admin or peer token, or
a read, train or admin token scoped to the decoys (``jobs=decoy-*``, server/rpc/scopes.py).
The requests cover the runs (leases of ``guarded-run``'s ranks, its slots), shared segments
(every caller holds a confirmed one, renewed each batch, and requests reference any of them)
and sessions (batches of data-plane calls, each call's reply code counted). The run stops at
``PARAMSHARD_CHAOS_REQUESTS`` requests or ``PARAMSHARD_CHAOS_SECONDS`` seconds (default 600).

Checked after every batch:
- the server process is alive and answers, and its log has no error; its resident memory stays
  under --max-memory plus 768 MiB (it runs under RLIMIT_DATA 4 GiB, so a memory bomb fails in
  the server, not on the host);
- no call got INTERNAL or UNKNOWN, or hung until the client's deadline; a call whose role may
  not call the method got UNAUTHENTICATED (no or unknown token) or PERMISSION_DENIED; a scoped
  token's call (or call carried by its session) naming a job or run outside ``decoy-*`` got
  PERMISSION_DENIED;
- ``guarded`` is bitwise unchanged: parameters, optimizer state, version, step counts,
  hyper-parameters, layout, pending contributions (Status and pulls with the read token).
  Mutating calls whose role may change it are sent to a decoy instead ("redirected"), except
  for a sample of "guarded" calls, each run alone between two reads of the job's state: a
  refused one must leave it as it was; an accepted one is undone by restoring ``baseline``,
  which must bring back the same bits. Scoped tokens are never redirected: their calls name
  ``guarded`` and its run as often as the decoys.
- ``guarded-run`` goes on: both of its ranks' leases renew without an abort notice or a rank
  awaited, and its all-reduce slot of the batch still holds the one contribution it had.
At the end the ``baseline`` snapshot's files are unchanged too. The seed is
``PARAMSHARD_CHAOS_SEED``; the decoys' versions (which the templates use) depend on the order
concurrent calls ran in, so a seed fixes the requests' kinds, not every byte.

One fast test per defect it found: tests/test_fuzz_findings.py.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import resource
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from chaos_requests import FuzzRequest, make_request
from chaos_target import DATA_LIMIT, MAX_MEMORY, TOKENS, Target, difference, job_state, metadata
from chaos_values import DECOYS, GUARDED, Method, methods
from google.protobuf import message_factory

from paramshard.protos import shard_pb2 as pb
from paramshard.server.rpc import auth, scopes

pytestmark = pytest.mark.timeout(900)

ROLES = ("none", "unknown", "malformed", *TOKENS)
ROLE_WEIGHTS = np.array([5, 4, 2, 10, 20, 25, 8, 6, 10, 10], float) / 100
BATCH, IN_FLIGHT, GUARDED_SHARE = 200, 8, 0.08
DEADLINE_S = 20.0  # the server waits at most --max-wait-s 0.3: reaching this is a hang
CRASH_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
RSS_SLACK = 768 * 2**20  # the interpreter, grpcio, threads: more than this over is a leak
# grpcio-health-checking's servicer lacks Health.List: UNIMPLEMENTED, and grpcio logs an error
LIBRARY_LOG = "Exception calling application: Method not implemented!"


def expected_refusal(role: str, method: Method) -> grpc.StatusCode | None:
    """The code the token check must give ``role`` for ``method`` (None: it passes)."""
    need = auth.required_role(method.path)
    if need is None:
        return None
    if role in ("none", "unknown", "malformed"):
        return grpc.StatusCode.UNAUTHENTICATED
    name = method.path.rsplit("/", 1)[-1]  # the peer role may call the segment methods too
    base = role.partition("@")[0]
    return None if auth.role_allows(base, need, name) else grpc.StatusCode.PERMISSION_DENIED


def outside_scope(role: str, method: str, body: bytes) -> bool:
    """Whether a scoped ``role``'s request ``body`` of ``method`` names a job or run outside
    ``decoy-*`` (False for unscoped roles, and bodies that do not parse)."""
    route = scopes.ROUTES.get(method)
    if "@" not in role or route is None or not route.checked:
        return False
    service = pb.DESCRIPTOR.services_by_name["Shard"]
    cls = message_factory.GetMessageClass(service.methods_by_name[method].input_type)
    try:
        name: Any = cls.FromString(body)
    except Exception:  # noqa: BLE001 - garbage: the server says what it says
        return False
    for field in route.path:
        name = getattr(name, field)
    if route.kind == "key":
        name = name.split(":", 1)[0]
    if route.kind == "listing" and not name:
        return False
    return not name.startswith("decoy-")


def mutating(method: Method) -> bool:
    """Whether a method may change a job: every Shard method the read role may not call, and
    sessions, which carry train calls."""
    need = auth.required_role(method.path)
    return need is not None and (method.name == "Session" or not auth.role_allows("read", need))


NOT_UNDONE = frozenset({"DeleteSnapshot"})
"""Mutating methods left out of the guarded sample: an accepted call removes a snapshot, which
restoring ``baseline`` cannot bring back (it may be ``baseline`` itself). Redirected to a
decoy like the others, and scoped tokens name ``guarded`` with it as with every method."""


# ---------------------------------------------------------------------------------- the calls
def send(channel: grpc.Channel, req: FuzzRequest) -> tuple[grpc.StatusCode, str, float, list]:
    """One call of raw bytes (identity serialisers); (code, details, seconds, a stream's
    replies)."""
    m, ident = req.method, {"request_serializer": None, "response_deserializer": None}
    began = time.monotonic()
    replies: list[bytes] = []
    timeout = DEADLINE_S if not m.server_streaming else 1.0  # Health.Watch never ends
    try:
        if not m.client_streaming and not m.server_streaming:
            channel.unary_unary(m.path, **ident)(
                req.payloads[0], timeout=timeout, metadata=metadata(req.role)
            )
        elif not m.client_streaming:
            call = channel.unary_stream(m.path, **ident)
            for _ in call(req.payloads[0], timeout=timeout, metadata=metadata(req.role)):
                pass
        elif not m.server_streaming:
            channel.stream_unary(m.path, **ident)(
                iter(req.payloads), timeout=timeout, metadata=metadata(req.role)
            )
        else:
            call = channel.stream_stream(m.path, **ident)
            for reply in call(iter(req.payloads), timeout=timeout, metadata=metadata(req.role)):
                replies.append(reply)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
    return code, details, time.monotonic() - began, replies


def describe(req: FuzzRequest, code: grpc.StatusCode, details: str) -> str:
    """A failure, with what it takes to replay the request."""
    payload = req.payloads[0]
    return (
        f"{req.method.path} role={req.role} kind={req.kind} job={req.job} -> {code.name}:"
        f" {details[:300]!r}; request ({len(payload)} bytes) {payload[:400].hex()}"
    )


class Fuzzer:
    def __init__(self, target: Target, seed: int) -> None:
        self.target = target
        self.rng = np.random.default_rng(seed)
        self.methods = methods()
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.roles: collections.Counter = collections.Counter()
        self.guarded: collections.Counter = collections.Counter()
        self.carried: collections.Counter = collections.Counter()  # session calls, by code
        self.out_of_scope: collections.Counter = collections.Counter()  # checked, by where
        self.run_checks = 0
        self.peak_rss = 0
        self.failures: list[str] = []
        self.channel = grpc.insecure_channel(
            target.address, options=[("grpc.max_receive_message_length", -1)]
        )

    def request(self, guarded: bool) -> FuzzRequest:
        rng = self.rng
        pool = [m for m in self.methods if mutating(m) and m.name not in NOT_UNDONE]
        pool = pool if guarded else self.methods
        method = pool[int(rng.integers(len(pool)))]
        role = str(rng.choice(ROLES, p=ROLE_WEIGHTS))
        jobs = [GUARDED, GUARDED, *DECOYS, *DECOYS, "nojob", "../guarded"]
        job = GUARDED if guarded else str(rng.choice(jobs))
        redirect = runs_to = None
        if "@" not in role and mutating(method) and expected_refusal(role, method) is None:
            decoy = DECOYS[int(rng.integers(len(DECOYS)))]
            if guarded:
                runs_to = decoy  # the job is guarded's; its run's leases cannot be restored
            else:
                redirect = decoy
        if redirect is not None and job == GUARDED:
            job = redirect
        return make_request(rng, method, role, job, self.target.ctx, redirect, runs_to)

    def record(
        self, req: FuzzRequest, code: grpc.StatusCode, details: str, took: float, replies: list
    ) -> None:
        self.counts[req.method.path][code.name] += 1
        self.roles[req.role] += 1
        if code in CRASH_CODES:
            self.failures.append(describe(req, code, details))
        elif took >= DEADLINE_S * 0.95 and not req.method.server_streaming:
            self.failures.append("hang: " + describe(req, code, details))
        want = expected_refusal(req.role, req.method)
        if want is None and req.kind != "garbage" and req.method.service == "paramshard.v1.Shard":
            if outside_scope(req.role, req.method.name, req.payloads[0]):
                want = grpc.StatusCode.PERMISSION_DENIED
                self.out_of_scope["unary"] += 1
        if want is not None and code != want:
            self.failures.append(f"expected {want.name}: " + describe(req, code, details))
        if req.method.path == "/paramshard.v1.Shard/Session" and req.kind != "garbage":
            self.record_carried(req, replies)
        if code == grpc.StatusCode.UNIMPLEMENTED and req.method.service == "paramshard.v1.Shard":
            self.failures.append("not served: " + describe(req, code, details))

    def record_carried(self, req: FuzzRequest, replies: list[bytes]) -> None:
        """The calls a session carried: no crash codes, and a scoped token's calls naming
        another job or run refused, each in its reply."""
        sent = {c.id: c for p in req.payloads for c in pb.SessionBatch.FromString(p).calls}
        for raw in replies:
            for reply in pb.SessionBatch.FromString(raw).calls:
                code = next(c for c in grpc.StatusCode if c.value[0] == reply.code)
                self.carried[code.name] += 1
                call = sent.get(reply.id)
                what = f"session call {reply.id} ({call.method if call else '?'}) -> {code.name}"
                if code in CRASH_CODES:
                    self.failures.append(
                        f"{what}: {reply.details[:300]}: " + describe(req, code, "")
                    )
                elif call is not None and outside_scope(req.role, call.method, call.body):
                    self.out_of_scope["carried by a session"] += 1
                    if code != grpc.StatusCode.PERMISSION_DENIED:
                        self.failures.append(
                            f"{what}, expected PERMISSION_DENIED: " + describe(req, code, "")
                        )

    def check_run(self, after: str) -> None:
        """``guarded-run`` went on (Target.run_state)."""
        self.run_checks += 1
        problem = self.target.run_state()
        if problem:
            self.failures.append(f"guarded run changed ({problem}) {after}")

    def batch(self, pool: cf.ThreadPoolExecutor, size: int) -> None:
        t = self.target
        t.maintain()
        plain, guarded = [], []
        for _ in range(size):
            is_guarded = self.rng.random() < GUARDED_SHARE
            (guarded if is_guarded else plain).append(self.request(is_guarded))
        results = list(pool.map(lambda r: send(self.channel, r), plain))
        for req, result in zip(plain, results, strict=True):
            self.record(req, *result)
        self.check_alive(plain)
        accepted = [describe(r, c, d) for r, (c, d, *_) in zip(plain, results, strict=True)]
        self.check_run(
            "in a batch without guarded calls; the calls that succeeded: "
            + "\n  ".join(a for a in accepted if " -> OK" in a)
        )
        state = job_state(t.reader, GUARDED)
        if state != t.baseline:
            self.failures.append(
                f"guarded job changed ({difference(t.baseline, state)}) in a batch without"
                " guarded calls; the calls that succeeded: "
                + "\n  ".join(a for a in accepted if " -> OK" in a)
            )
            self.roll_back()
        for req in guarded:  # one at a time, between two reads of the job's state
            code, details, took, replies = send(self.channel, req)
            self.record(req, code, details, took, replies)
            self.check_run("by " + describe(req, code, details))
            after = job_state(t.reader, GUARDED)
            if code != grpc.StatusCode.OK:
                self.guarded["refused"] += 1
                if after != t.baseline:
                    self.failures.append(
                        f"refused call changed the job ({difference(t.baseline, after)}): "
                        + describe(req, code, details)
                    )
                    self.roll_back()
            elif after != t.baseline:
                self.guarded["accepted, changed, rolled back"] += 1
                self.roll_back(f"after {describe(req, code, details)}")
            else:
                self.guarded["accepted, unchanged"] += 1

    def roll_back(self, after: str = "") -> None:
        """Brings ``guarded`` back to baseline, or ends the run: every later check needs it."""
        t = self.target
        t.roll_back()
        state = job_state(t.reader, GUARDED)
        if state != t.baseline:
            pytest.fail(
                f"restoring 'baseline' did not bring the job back ({difference(t.baseline, state)})"
                f" {after}\n" + "\n".join(self.failures)
            )

    def check_alive(self, batch: list[FuzzRequest] = ()) -> None:
        serve = self.target.serve
        assert serve.proc.poll() is None, f"server exited {serve.proc.returncode}: {serve.stderr}"
        rss = serve.rss()
        self.peak_rss = max(self.peak_rss, rss)
        if rss > MAX_MEMORY + RSS_SLACK:
            pytest.fail(
                f"the server holds {rss:,} bytes, over --max-memory {MAX_MEMORY:,} plus"
                f" {RSS_SLACK:,}; the batch:\n"
                + "\n".join(describe(r, grpc.StatusCode.OK, "") for r in batch)
            )
        lines = serve.stderr[:]
        del serve.stderr[: len(lines)]
        for line in lines:
            if LIBRARY_LOG in line:
                continue
            if " ERROR " in line or "Exception in thread" in line or "Fatal" in line:
                self.failures.append(f"server log: {line}")

    def report(self, seconds: float) -> str:
        total = sum(sum(c.values()) for c in self.counts.values())
        codes: collections.Counter = collections.Counter()
        lines = [
            f"{total:,} requests in {seconds:.1f} s (server peak RSS {self.peak_rss / 2**20:.0f}"
            " MiB); by method and status code:"
        ]
        for path, c in sorted(self.counts.items()):
            codes.update(c)
            row = ", ".join(f"{k} {v}" for k, v in c.most_common())
            lines.append(f"  {path} ({sum(c.values())}): {row}")
        lines.append("by code: " + ", ".join(f"{k} {v}" for k, v in codes.most_common()))
        lines.append("by role: " + ", ".join(f"{k} {v}" for k, v in self.roles.most_common()))
        lines.append("guarded calls: " + ", ".join(f"{k} {v}" for k, v in self.guarded.items()))
        lines.append("calls carried by sessions: " + ", ".join(
            f"{k} {v}" for k, v in self.carried.most_common()))  # fmt: skip
        lines.append("scoped calls naming guarded or its run, checked refused: " + ", ".join(
            f"{k} {v}" for k, v in self.out_of_scope.items()))  # fmt: skip
        lines.append(f"guarded run checked {self.run_checks} times")
        return "\n".join(lines)


@pytest.fixture
def target(tmp_path: Path) -> Any:
    """The server under test; meanwhile this process may grow by DATA_LIMIT at most, so a
    client tool that believes a hostile reply (it once built list(range(2**31))) fails here
    with MemoryError instead of taking the host."""
    with open("/proc/self/status") as f:
        used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = used + DATA_LIMIT if hard == resource.RLIM_INFINITY else min(hard, used + DATA_LIMIT)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    t = Target(tmp_path)
    try:
        yield t
    finally:
        t.close()
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


@pytest.mark.slow
def test_fuzzed_requests_change_nothing_and_crash_nothing(target: Target) -> None:
    total = int(os.environ.get("PARAMSHARD_CHAOS_REQUESTS", "10000"))
    budget = float(os.environ.get("PARAMSHARD_CHAOS_SECONDS", "600"))
    fuzzer = Fuzzer(target, int(os.environ.get("PARAMSHARD_CHAOS_SEED", "13")))
    began = time.monotonic()
    with cf.ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="fuzz") as pool:
        done = 0
        while done < total and len(fuzzer.failures) < 20 and time.monotonic() - began < budget:
            size = min(BATCH, total - done)
            fuzzer.batch(pool, size)
            done += size
    fuzzer.check_alive()
    report = fuzzer.report(time.monotonic() - began)
    print(report)
    assert not fuzzer.failures, "\n".join(fuzzer.failures[:20]) + "\n" + report
    assert job_state(target.reader, GUARDED) == target.baseline
    assert target.snapshot_files(GUARDED, "baseline") == target.baseline_files
    shard = {m.path for m in methods() if m.service == "paramshard.v1.Shard"}
    assert shard <= set(fuzzer.counts), f"never called: {shard - set(fuzzer.counts)}"
    assert sum(sum(c.values()) for c in fuzzer.counts.values()) >= done
    if done >= 1000:  # enough requests that each kind of check must have run
        assert fuzzer.carried and fuzzer.run_checks >= done // BATCH, report
        assert set(fuzzer.out_of_scope) == {"unary", "carried by a session"}, report
