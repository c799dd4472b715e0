"""Issue 13, chaos suite, fuzz part: fuzzed requests over every method with random roles.

A real ``paramshard serve`` process with a token file (read, train, admin and peer tokens) on
127.0.0.1:0 holds a legit job, ``guarded`` (two buffers, Adam and SGD-momentum state, version
2, a committed snapshot ``baseline``), and two decoy jobs. Then ``PARAMSHARD_CHAOS_REQUESTS``
(default 10,000) requests made by tests/chaos_requests.py go to every method of the Shard
service (enumerated from protos/shard_pb2.py, so a new method is covered at once) and of the
open health and reflection services, in batches, several calls in flight, each with a random
caller: no token, an unknown token, a malformed header, or a read, train, admin or peer token.

Checked after every batch:
- the server process is alive and answers, and its log has no error; its resident memory stays
  under --max-memory plus 768 MiB (it runs under RLIMIT_DATA 4 GiB, so a memory bomb fails in
  the server, not on the host);
- no call got INTERNAL or UNKNOWN, or hung until the client's deadline; a call whose role may
  not call the method got UNAUTHENTICATED (no or unknown token) or PERMISSION_DENIED;
- ``guarded`` is bitwise unchanged: parameters, optimizer state, version, step counts,
  hyper-parameters, layout, pending contributions (Status and pulls with the read token).
  Mutating calls whose role may change it are sent to a decoy instead ("redirected"), except
  for a sample of "guarded" calls, each run alone between two reads of the job's state: a
  refused one must leave it as it was; an accepted one is undone by restoring ``baseline``,
  which must bring back the same bits.
At the end the ``baseline`` snapshot's files are unchanged too. The seed is
``PARAMSHARD_CHAOS_SEED``; the decoys' versions (which the templates use) depend on the order
concurrent calls ran in, so a seed fixes the requests' kinds, not every byte.

One fast test per defect it found: tests/test_fuzz_findings.py.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import hashlib
import json
import os
import queue
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from chaos_requests import DECOYS, GUARDED, Context, FuzzRequest, Method, N, make_request, methods

from paramshard.client import ClusterSpec, ParamInfo, ShardClient, ShardClientError, StepArgs, tools
from paramshard.protos import shard_pb2 as pb
from paramshard.server import MALLOC_ENV
from paramshard.server.rpc import auth

pytestmark = pytest.mark.timeout(900)

TOKENS = {"read": "fz-reader", "train": "fz-trainer", "admin": "fz-admin", "peer": "fz-peer"}
ROLES = ("none", "unknown", "malformed", "read", "train", "admin", "peer")
ROLE_WEIGHTS = np.array([6, 5, 3, 14, 27, 35, 10], float) / 100
BATCH, IN_FLIGHT, GUARDED_SHARE = 200, 8, 0.08
DEADLINE_S = 20.0  # the server waits at most --max-wait-s 0.3: reaching this is a hang
CRASH_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
MAX_MEMORY = 256 * 2**20  # the server's --max-memory
RSS_SLACK = 768 * 2**20  # the interpreter, grpcio, threads: more than this over is a leak
DATA_LIMIT = 4 * 2**30  # RLIMIT_DATA of the server: a memory bomb fails there, not the host
ROOT = Path(__file__).resolve().parents[1]
# grpcio-health-checking's servicer lacks Health.List: UNIMPLEMENTED, and grpcio logs an error
LIBRARY_LOG = "Exception calling application: Method not implemented!"


def metadata(role: str) -> tuple[tuple[str, str], ...]:
    if role == "none":
        return ()
    if role == "unknown":
        return (("authorization", "Bearer not-a-token"),)
    if role == "malformed":
        return (("authorization", "Basic fz-admin"),)
    return (("authorization", f"Bearer {TOKENS[role]}"),)


def expected_refusal(role: str, method: Method) -> grpc.StatusCode | None:
    """The code the token check must give ``role`` for ``method`` (None: it passes)."""
    need = auth.required_role(method.path)
    if need is None:
        return None
    if role in ("none", "unknown", "malformed"):
        return grpc.StatusCode.UNAUTHENTICATED
    name = method.path.rsplit("/", 1)[-1]  # the peer role may call the segment methods too
    return None if auth.role_allows(role, need, name) else grpc.StatusCode.PERMISSION_DENIED


def mutating(method: Method) -> bool:
    """Whether a method may change a job: every Shard method the read role may not call."""
    need = auth.required_role(method.path)
    return need is not None and not auth.role_allows("read", need)


# ---------------------------------------------------------------------------------- the server
class ServeProcess:
    """``paramshard serve ARGS`` in the background, its private memory capped (RLIMIT_DATA),
    so a request that allocates without bound fails in the server, not on the host."""

    LISTENING = re.compile(r"^paramshard serve: listening on (\S+) ")

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))

        def cap() -> None:
            resource.setrlimit(resource.RLIMIT_DATA, (DATA_LIMIT, DATA_LIMIT))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "paramshard", "serve", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=cap,  # noqa: PLW1509 - setrlimit only, before exec
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        for stream, sink in (
            (self.proc.stdout, self.lines.put),
            (self.proc.stderr, self.stderr.append),
        ):
            threading.Thread(target=self._read, args=(stream, sink), daemon=True).start()
        line = self.lines.get(timeout=30)
        match = self.LISTENING.match(line)
        assert match, f"{line!r}; stderr: {self.stderr}"
        self.port = int(match.group(1).rsplit(":", 1)[1])

    @staticmethod
    def _read(stream: Any, sink: Any) -> None:
        for line in stream:
            sink(line.rstrip("\n"))

    def rss(self) -> int:
        """Resident bytes of the server process."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb * 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def client(address: str, role: str = "admin") -> ShardClient:
    return ShardClient(ClusterSpec([address], token=TOKENS[role]), timeout_s=10.0, retries=0)


def register(c: ShardClient, job: str) -> None:
    """Buffer "w" (two parameters, Adam) and "v" (SGD with momentum, float64 master)."""
    params = [ParamInfo("a", (8, 4), 0), ParamInfo("b", (32,), 32)]
    c.register_buffer(job, "w", N, params=params, optimizer="adam", hyper={"lr": 0.01})
    c.register_buffer(
        job, "v", 7, optimizer="sgd", hyper={"lr": 0.1, "momentum": 0.9}, master_dtype="float64"
    )
    c.set_params(job, "w", np.linspace(-1, 1, N, dtype=np.float32))
    c.set_params(job, "v", np.arange(7, dtype=np.float64) / 3)


def train(c: ShardClient, job: str, steps: int) -> None:
    for s in range(steps):
        c.push_grads(job, "w", np.cos(np.arange(N, dtype=np.float32) + s), s)
        c.push_grads(job, "v", np.sin(np.arange(7, dtype=np.float64) + s), s, dtype="float64")
        c.step(job, s, {"w": StepArgs({"lr": 0.01}), "v": StepArgs({"lr": 0.1})})


def job_state(reader: ShardClient, job: str) -> Any:
    """Everything the server holds of ``job``, bitwise: layout, versions, step counts,
    hyper-parameters, pending contributions, parameters and optimizer state arrays."""
    try:
        reply = reader.call(0, "Status", pb.StatusRequest(pending=True, max_pending=1000))
        rows = [j for j in reply.jobs if j.job == job]
        if not rows:
            return "missing"
        (row,) = rows
        state: list[Any] = [row.server_index, row.num_servers, row.model_config]
        for b in sorted(row.buffers, key=lambda b: b.buffer):
            fixed = pb.BufferStatus()
            fixed.CopyFrom(b)
            fixed.ClearField("last_step_seconds")  # a duration, not state
            state.append(fixed.SerializeToString(deterministic=True))
            arrays = {"params": ""} | {k: k for k in b.state_keys}
            for name, key in arrays.items():
                out = np.empty(b.slice_numel, dtype=b.dtype)
                reader.run(reader.pull_calls(job, b.buffer, out, 0, dtype=b.dtype, state=key))
                state.append((b.buffer, name, out.tobytes()))
        for p in reply.pending:  # its steps' contributions (a slot's run is not a job)
            if p.kind == "push_grad" and p.key.startswith(f"{job}/"):
                state.append((p.kind, p.seq, p.key, p.expected, list(p.arrived), list(p.missing)))
        return state
    except ShardClientError as exc:
        return f"unreadable: {exc.code.name}: {exc.details}"


def difference(before: Any, after: Any) -> str:
    """The first thing that differs between two ``job_state`` results, readably."""
    if isinstance(before, str) or isinstance(after, str):
        return f"{str(before)[:300]} -> {str(after)[:300]}"
    if len(before) != len(after):
        gone = [x for x in before if x not in after][:3]
        new = [x for x in after if x not in before][:3]
        return f"gone: {str(gone)[:400]}; new: {str(new)[:400]}"
    for a, b in zip(before, after, strict=True):
        if a == b:
            continue
        if isinstance(a, bytes):  # a BufferStatus
            return f"{pb.BufferStatus.FromString(a)} -> {pb.BufferStatus.FromString(b)}"
        if isinstance(a, tuple) and isinstance(a[-1], bytes):
            return (
                f"{a[:2]}: {sum(x != y for x, y in zip(a[-1], b[-1], strict=False))} bytes differ"
            )
        return f"{a} -> {b}"
    return "equal"


class Target:
    """The server under test, the jobs on it, and the clients that set them up and check them."""

    def __init__(self, tmp: Path) -> None:
        tokens = tmp / "tokens"
        tokens.write_text("".join(f"{role} {t}\n" for role, t in TOKENS.items()))
        tokens.chmod(0o600)
        self.snapshots = tmp / "snapshots"
        args = ["--host", "127.0.0.1", "--port", "0", "--token-file", str(tokens)]
        args += ["--snapshot-dir", str(self.snapshots), "--max-memory", "256MiB"]
        args += ["--max-wait-s", "0.3", "--pending-ttl", "5"]
        self.serve = ServeProcess(*args)
        self.address = f"127.0.0.1:{self.serve.port}"
        self.admin, self.reader = client(self.address), client(self.address, "read")
        register(self.admin, GUARDED)
        train(self.admin, GUARDED, 2)
        tools.snapshot(self.admin, GUARDED, "baseline")
        # restored once, so the state a roll-back brings back is the state checked against
        # (a restored slice has no gradient accumulator yet and no time of a last step)
        tools.restore(self.admin, GUARDED, "baseline")
        self.baseline = job_state(self.reader, GUARDED)
        self.baseline_files = self.snapshot_files(GUARDED, "baseline")
        self.ctx = Context(self.address)
        self.maintain()
        tools.snapshot(self.admin, DECOYS[0], "d0")
        self.ctx.manifest = json.loads(
            (self.snapshots / DECOYS[0] / "d0/manifest.json").read_text()
        )

    def snapshot_files(self, job: str, tag: str) -> dict[str, str]:
        folder = self.snapshots / job / tag
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}

    def maintain(self) -> None:
        """Between batches: jobs the fuzzer made are dropped (memory), broken decoys made anew;
        the templates learn the decoys' versions."""
        jobs = {j.job: j for j in self.admin.call(0, "Status", pb.StatusRequest()).jobs}
        for job, row in list(jobs.items()):
            whole = {b.buffer for b in row.buffers if b.initialized} == {"w", "v"}
            if job != GUARDED and (job not in DECOYS or not whole or len(row.buffers) != 2):
                self.admin.call(0, "DropJob", pb.DropJobRequest(job=job))
                jobs.pop(job)
        for job in DECOYS:
            if job not in jobs:
                register(self.admin, job)
        status = self.admin.call(0, "Status", pb.StatusRequest())
        self.ctx.versions = {
            j.job: b.version for j in status.jobs for b in j.buffers if b.buffer == "w"
        }

    def roll_back(self) -> None:
        """Restores ``guarded`` from ``baseline`` (after a guarded call that was accepted)."""
        try:
            tools.restore(self.admin, GUARDED, "baseline")
        except ShardClientError as exc:
            if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            self.maintain()  # the fuzzer's jobs filled the memory limit: free it, try again
            tools.restore(self.admin, GUARDED, "baseline")

    def close(self) -> None:
        self.admin.close()
        self.reader.close()
        self.serve.stop()


# ---------------------------------------------------------------------------------- the calls
def send(channel: grpc.Channel, req: FuzzRequest) -> tuple[grpc.StatusCode, str, float]:
    """One call of raw bytes (identity serialisers); (code, details, seconds)."""
    m, ident = req.method, {"request_serializer": None, "response_deserializer": None}
    began = time.monotonic()
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
            for _ in call(iter(req.payloads), timeout=timeout, metadata=metadata(req.role)):
                pass
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
    return code, details, time.monotonic() - began


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
        self.peak_rss = 0
        self.failures: list[str] = []
        self.channel = grpc.insecure_channel(
            target.address, options=[("grpc.max_receive_message_length", -1)]
        )

    def request(self, guarded: bool) -> FuzzRequest:
        rng = self.rng
        pool = [m for m in self.methods if mutating(m)] if guarded else self.methods
        method = pool[int(rng.integers(len(pool)))]
        role = str(rng.choice(ROLES, p=ROLE_WEIGHTS))
        jobs = [GUARDED, GUARDED, *DECOYS, *DECOYS, "nojob", "../guarded"]
        job = GUARDED if guarded else str(rng.choice(jobs))
        redirect = None
        if not guarded and mutating(method) and expected_refusal(role, method) is None:
            redirect = DECOYS[int(rng.integers(len(DECOYS)))]
        if redirect is not None and job == GUARDED:
            job = redirect
        return make_request(rng, method, role, job, self.target.ctx, redirect)

    def record(self, req: FuzzRequest, code: grpc.StatusCode, details: str, took: float) -> None:
        self.counts[req.method.path][code.name] += 1
        self.roles[req.role] += 1
        if code in CRASH_CODES:
            self.failures.append(describe(req, code, details))
        elif took >= DEADLINE_S * 0.95 and not req.method.server_streaming:
            self.failures.append("hang: " + describe(req, code, details))
        want = expected_refusal(req.role, req.method)
        if want is not None and code != want:
            self.failures.append(f"expected {want.name}: " + describe(req, code, details))
        if code == grpc.StatusCode.UNIMPLEMENTED and req.method.service == "paramshard.v1.Shard":
            self.failures.append("not served: " + describe(req, code, details))

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
        state = job_state(t.reader, GUARDED)
        if state != t.baseline:
            accepted = [describe(r, c, d) for r, (c, d, _) in zip(plain, results, strict=True)]
            self.failures.append(
                f"guarded job changed ({difference(t.baseline, state)}) in a batch without"
                " guarded calls; the calls that succeeded: "
                + "\n  ".join(a for a in accepted if " -> OK" in a)
            )
            self.roll_back()
        for req in guarded:  # one at a time, between two reads of the job's state
            code, details, took = send(self.channel, req)
            self.record(req, code, details, took)
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
    fuzzer = Fuzzer(target, int(os.environ.get("PARAMSHARD_CHAOS_SEED", "13")))
    began = time.monotonic()
    with cf.ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="fuzz") as pool:
        done = 0
        while done < total and len(fuzzer.failures) < 20:
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
    assert sum(sum(c.values()) for c in fuzzer.counts.values()) >= total
