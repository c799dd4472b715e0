"""The server the chaos fuzzer (tests/test_chaos_fuzz.py) runs against, and what it guards.

A real ``paramshard serve`` process with a token file (read, train, admin and peer tokens, and
read, train and admin tokens scoped to the decoys, ``jobs=decoy-*``) on 127.0.0.1:0, under
RLIMIT_DATA, holding the guarded job (two buffers, Adam and SGD-momentum state, version 2, a
committed snapshot ``baseline``), its run ``guarded-run`` (two ranks' leases, an all-reduce slot
half contributed, made anew each batch), two decoy jobs, and one confirmed shared segment per
token. ``job_state`` reads a job bitwise; ``Target.run_state`` says whether the run went on.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from chaos_values import DECOYS, GUARDED, Context, N, run_of

from paramshard.client import ClusterSpec, ParamInfo, ShardClient, ShardClientError, StepArgs, tools
from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.shm import PROOF_BYTES
from paramshard.server import MALLOC_ENV

__all__ = [
    "TOKENS",
    "SCOPE",
    "GUARDED_RUN",
    "MAX_MEMORY",
    "DATA_LIMIT",
    "metadata",
    "grants",
    "client",
    "job_state",
    "difference",
    "Target",
]

TOKENS = {"read": "fz-reader", "train": "fz-trainer", "admin": "fz-admin", "peer": "fz-peer"}
TOKENS |= {"read@decoy": "fz-reader-d", "train@decoy": "fz-trainer-d", "admin@decoy": "fz-admin-d"}
SCOPE = "jobs=decoy-*"  # and runs=decoy-*: the decoys' runs, decoy-a-run, ...
GUARDED_RUN = run_of(GUARDED)
MAX_MEMORY = 256 * 2**20  # the server's --max-memory
DATA_LIMIT = 4 * 2**30  # RLIMIT_DATA of the server: a memory bomb fails there, not the host
ROOT = Path(__file__).resolve().parents[1]


def metadata(role: str) -> tuple[tuple[str, str], ...]:
    if role == "none":
        return ()
    if role == "unknown":
        return (("authorization", "Bearer not-a-token"),)
    if role == "malformed":
        return (("authorization", "Basic fz-admin"),)
    return (("authorization", f"Bearer {TOKENS[role]}"),)


def grants() -> dict[str, str]:
    """{token: its role, and its scope for the scoped ones} (a token file's lines)."""
    return {t: role.partition("@")[0] + (f" {SCOPE}" if "@" in role else "") for role, t in
            TOKENS.items()}  # fmt: skip


# ---------------------------------------------------------------------------------- the server
class ServeProcess:
    """``paramshard serve ARGS`` in the background, its private memory capped (RLIMIT_DATA),
    so a request that allocates without bound fails in the server, not on the host."""

    LISTENING = re.compile(r"^paramshard serve: listening on (\S+) ")

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        # the shell caps the server's data segment (ulimit -d: KiB): a preexec_fn would fork
        # this process, whose gRPC threads (its clients) may hang or abort the child
        cap = f'ulimit -d {DATA_LIMIT // 1024} && exec "$0" -m paramshard serve "$@"'
        self.proc = subprocess.Popen(
            ["sh", "-c", cap, sys.executable, *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
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
        tokens.write_text("".join(f"{g.split()[0]} {t} {' '.join(g.split()[1:])}\n"
                                  for t, g in grants().items()))  # fmt: skip
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
        self.mappings: list[Any] = []
        self.slot = ""  # the guarded run's slot of the current batch
        self.hold_run()
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
        self.renew_segments()
        self.slot = f"{GUARDED_RUN}:ar{time.monotonic_ns()}/0"  # a fresh one: slots expire
        self.slot_made = time.monotonic()
        code, details, _ = raw_call(self.address, "Contribute", contribution(self.slot, 0))
        assert code == grpc.StatusCode.OK, details

    def hold_run(self) -> None:
        """Both ranks of ``guarded-run`` hold leases (for the test's whole length)."""
        for rank in (0, 1):
            code, details, _ = raw_call(self.address, "Lease", run_lease(rank))
            assert code == grpc.StatusCode.OK, details

    def run_state(self) -> str:
        """ "" while ``guarded-run`` goes on (no abort, no rank awaited, its slot as it was),
        else what changed (the run is then made anew)."""
        problems = []
        for rank in (0, 1):
            code, details, reply = raw_call(self.address, "Lease", run_lease(rank))
            notice = pb.LeaseReply.FromString(reply) if code == grpc.StatusCode.OK else None
            if notice is None or notice.aborted or notice.awaiting:
                problems.append(f"rank {rank}'s renewal: {code.name} {details} {notice}")
        status = self.admin.call(0, "Status", pb.StatusRequest(pending=True, max_pending=1000))
        rows = [(list(p.arrived), p.expected) for p in status.pending if p.key == self.slot]
        expired = time.monotonic() - self.slot_made > 4.5  # --pending-ttl 5
        if rows != [([0], 2)] and not (expired and not rows):
            problems.append(f"slot {self.slot}: {rows}")
        if problems:
            self.admin.call(0, "DropJob", pb.DropJobRequest(job=GUARDED_RUN))
            self.hold_run()
        return "; ".join(problems)

    def renew_segments(self) -> None:
        """Every caller holds one confirmed shared segment; the requests may name any of
        them (segments idle for --pending-ttl expire, so they are made anew each batch)."""
        for mapping in self.mappings:
            mapping.close()
        released = pb.ReleaseSegmentsRequest(segments=self.ctx.segments)
        for role in TOKENS:
            raw_call(self.address, "ReleaseSegments", released.SerializeToString(), role)
        self.ctx.segments, self.mappings = [], []
        for role in TOKENS:
            opened = open_segment(self.address, role)
            if opened is not None:
                self.ctx.segments.append(opened[0])
                self.mappings.append(opened[1])

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
        for mapping in self.mappings:
            mapping.close()
        self.admin.close()
        self.reader.close()
        self.serve.stop()


def raw_call(address: str, method: str, payload: bytes, role: str = "admin") -> Any:
    """One unary Shard call of raw bytes: (code, details, reply bytes or b"")."""
    with grpc.insecure_channel(address) as chan:
        stub = chan.unary_unary(f"/paramshard.v1.Shard/{method}")
        try:
            return grpc.StatusCode.OK, "", stub(payload, timeout=10, metadata=metadata(role))
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", b""


def run_lease(rank: int) -> bytes:
    return pb.LeaseRequest(
        run=GUARDED_RUN, rank=rank, world_size=2, ttl_ms=600_000
    ).SerializeToString()


def contribution(key: str, contributor: int) -> bytes:
    """Half of a 2-rank all-reduce of 4 floats."""
    header = pb.SlotHeader(
        key=key,
        expected=2,
        readers=2,
        total_numel=4,
        chunk=pb.Chunk(numel=4, dtype=pb.FLOAT32),
        chunk_numel=4,
        contributor=contributor,
    )
    return codec.encode(header, np.ones(4, np.float32))


def open_segment(address: str, role: str) -> tuple[int, mmap.mmap] | None:
    """A confirmed shared segment of ``role``'s token (1 MiB); None if the server offers none
    to that role."""
    offer = pb.OfferSegmentRequest(nbytes=2**20).SerializeToString()
    code, _, reply = raw_call(address, "OfferSegment", offer, role)
    if code != grpc.StatusCode.OK:
        return None
    got = pb.OfferSegmentReply.FromString(reply)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect("\0" + got.socket[1:])
        sock.sendall(got.ticket)
        _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    mapped = mmap.mmap(fds[0], got.nbytes)
    os.close(fds[0])
    confirm = pb.ConfirmSegmentRequest(segment=got.segment, proof=mapped[:PROOF_BYTES])
    code, details, _ = raw_call(address, "ConfirmSegment", confirm.SerializeToString(), role)
    assert code == grpc.StatusCode.OK, details
    return got.segment, mapped
