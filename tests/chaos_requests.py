"""Requests for the fuzz part of the chaos suite (tests/test_chaos_fuzz.py).

Every method comes from the generated descriptors (the Shard service of protos/shard_pb2.py,
plus the open health and reflection services), so a method added to shard.proto is fuzzed
without a change here. A request is one of:

- ``template``: a valid request for a known method (``valid_request``), then zero to three
  random field mutations (``mutate``): huge and negative-like numbers, empty, overlong and
  path-traversal strings, unknown dtypes and ops, shapes of 2**62, payloads whose size does
  not match the chunk, many repeated entries;
- ``random``: every field drawn at random from the request type's descriptor (the only kind a
  method without a template gets, besides garbage);
- ``garbage``: bytes that are not a well-formed request (random, truncated, bit-flipped,
  unterminated varints, huge declared lengths, bad wire types, deep groups, invalid UTF-8).

Sizes are bounded (strings <= 4 KiB, payloads <= 64 KiB, repeated fields <= 1,000 scalars,
requests <= 1 MiB), so the fuzzer stays small, and the only address a request names is on
loopback (``neighbour``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from paramshard.protos import shard_pb2 as pb
from paramshard.server.snapshots.files import Captured, encode_shard

__all__ = ["GUARDED", "DECOYS", "N", "Method", "Context", "methods", "make_request"]

GUARDED = "guarded"
"""The job the fuzzer must not change."""
DECOYS = ("decoy-a", "decoy-b")
"""Jobs that mutating calls with a role allowed to change them are sent to instead."""
N = 64  # elements of buffer "w" (adam); buffer "v" (sgd, float64 master) has 7

F = FieldDescriptor
U64 = (0, 1, 2, 3, 7, 63, 64, 65, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**62)
U64 += (2**63 - 1, 2**63, 2**64 - 1)
U32 = (0, 1, 2, 3, 7, 64, 2**16, 2**31 - 1, 2**31, 2**32 - 1)
I64 = (0, 1, -1, 2, 8, -(2**31), 2**32, 2**62, -(2**62), 2**63 - 1, -(2**63))
I32 = (0, 1, -1, 2, 2**31 - 1, -(2**31))
FLOATS = (0.0, -0.0, 1e-3, 0.1, 0.9, 1.0, -1.0, 2.0, 1e308, -1e308, 5e-324)
FLOATS += (math.nan, math.inf, -math.inf)
STRINGS = (
    GUARDED,
    *DECOYS,
    "",
    "w",
    "v",
    "x",
    "../guarded",
    "../../../../etc/passwd",
    "/etc/passwd",
    "guarded/../guarded",
    "..",
    ".",
    "guarded/",
    " guarded",
    "GUARDED",
    "gu\x00arded",
    "guarded.pp0.tp0",
    "latest",
    "baseline",
    "d0",
    "ünï©ødé",
    "%s%n{}",
    "a" * 300,
    "a" * 4096,
    "lr",
    "momentum",
    "exp_avg",
    "exp_avg_sq",
    "momentum_buffer",
    "sgd",
    "adam",
    "float32",
    "bfloat16",
    "{}",
    '{"architecture": "X", "config": {}}',
    "fz/all_reduce/0",
)
MAX_REQUEST = 2**20  # bytes of a request at most (an emptied one takes the place of a larger)
ITEMSIZE = {pb.FLOAT32: 4, pb.FLOAT16: 2, pb.BFLOAT16: 2, pb.INT64: 8, pb.INT32: 4, pb.FLOAT64: 8}


@dataclass(frozen=True)
class Method:
    """One RPC method of a service the server exposes."""

    service: str
    name: str
    request: Descriptor
    client_streaming: bool
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"


def methods() -> list[Method]:
    """Every method of the Shard service, then the health and reflection services' methods."""
    services = (
        pb.DESCRIPTOR.services_by_name["Shard"],
        health_pb2.DESCRIPTOR.services_by_name["Health"],
        reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
    )
    return [
        Method(s.full_name, m.name, m.input_type, m.client_streaming, m.server_streaming)
        for s in services
        for m in s.methods
    ]


@dataclass
class Context:
    """What templates need to know about the server under test."""

    address: str
    versions: dict[str, int] = field(default_factory=dict)  # job -> version of buffer "w"
    manifest: dict[str, Any] = field(default_factory=dict)  # a real manifest (decoy-a, d0)
    tags: int = 0  # fresh snapshot tags handed out

    def neighbours(self) -> tuple[str, ...]:
        """Replication targets a request may name: loopback addresses, and forms that name no
        host (no name a resolver would look up: the fuzzer reaches nothing beyond loopback)."""
        port = self.address.rsplit(":", 1)[1]
        others = ("127.0.0.1:1", "[::1]:1", "127.0.0.1:99999", "unix:/nonexistent", ":", "")
        return (self.address, f"localhost:{port}", *others)


def pick(rng: np.random.Generator, options: Any) -> Any:
    """One of ``options``, as it is (``rng.choice`` would turn 2**64 - 1 into a float)."""
    return options[int(rng.integers(len(options)))]


def _message(desc: Descriptor) -> Any:
    return message_factory.GetMessageClass(desc)()


def _payload(rng: np.random.Generator, dtype: int, numel: int) -> bytes:
    """``numel`` elements of wire dtype ``dtype``, sometimes not finite."""
    values = rng.standard_normal(numel)
    if numel and rng.random() < 0.1:
        values[rng.integers(numel)] = rng.choice([np.nan, np.inf, -np.inf])
    if dtype in (pb.FLOAT16, pb.BFLOAT16):
        return values.astype(np.float16).tobytes()
    wire = {pb.FLOAT64: np.float64, pb.INT64: np.int64, pb.INT32: np.int32}.get(dtype, np.float32)
    with np.errstate(invalid="ignore"):
        return values.astype(wire).tobytes()


def _bytes(rng: np.random.Generator) -> bytes:
    kind = rng.integers(6)
    if kind == 0:
        return b""
    if kind == 1:
        return rng.bytes(int(rng.integers(1, 65)))
    if kind == 2:
        return b"\x00" * int(rng.choice((3, 4096, 65536)))
    return _payload(rng, int(rng.choice(list(ITEMSIZE))), int(rng.choice((1, 2, 63, 64, 65, 1000))))


def _scalar(rng: np.random.Generator, f: FieldDescriptor, ctx: Context) -> Any:
    """A random value of a scalar field (by name where the name says more than the type)."""
    if f.name == "neighbour":
        return pick(rng, ctx.neighbours())
    if f.name == "manifest_json" and ctx.manifest:
        return _manifest(rng, ctx, GUARDED, "fz")
    small = int(rng.integers(0, 100))
    pools: dict[int, tuple] = {
        F.TYPE_UINT64: U64,
        F.TYPE_FIXED64: U64,
        F.TYPE_UINT32: U32,
        F.TYPE_FIXED32: U32,
        F.TYPE_INT64: I64,
        F.TYPE_SINT64: I64,
        F.TYPE_SFIXED64: I64,
        F.TYPE_INT32: I32,
        F.TYPE_SINT32: I32,
        F.TYPE_SFIXED32: I32,
    }
    if f.type in pools:
        return pick(rng, pools[f.type]) if rng.random() < 0.7 else small
    if f.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return pick(rng, FLOATS)
    if f.type == F.TYPE_BOOL:
        return bool(rng.integers(2))
    if f.type == F.TYPE_ENUM:
        known = [v.number for v in f.enum_type.values]
        return pick(rng, known + [7, 99, 2**31 - 1, -1])
    if f.type == F.TYPE_STRING:
        return pick(rng, STRINGS)
    if f.type == F.TYPE_BYTES:
        return _bytes(rng)
    raise AssertionError(f"no generator for field {f.full_name} of type {f.type}")


def _is_map(f: FieldDescriptor) -> bool:
    return f.type == F.TYPE_MESSAGE and f.message_type.GetOptions().map_entry


def _set(rng: np.random.Generator, msg: Any, f: FieldDescriptor, ctx: Context, depth: int) -> None:
    """Gives field ``f`` of ``msg`` a random value (entries, for repeated fields and maps)."""
    target = getattr(msg, f.name)
    if _is_map(f):
        entry = f.message_type.fields_by_name
        key_f, value_f = entry["key"], entry["value"]
        target.clear()
        for _ in range(int(rng.choice((0, 1, 3, 50)))):
            key = _scalar(rng, key_f, ctx)
            if value_f.type == F.TYPE_MESSAGE:
                target[key].CopyFrom(random_message(rng, value_f.message_type, ctx, depth + 1))
            else:
                target[key] = _scalar(rng, value_f, ctx)
        return
    if f.is_repeated:
        del target[:]
        if f.type == F.TYPE_MESSAGE:
            entry = random_message(rng, f.message_type, ctx, depth + 1)
            for _ in range(int(rng.choice((0, 1, 2, 50)))):
                target.add().CopyFrom(entry)
        else:
            count = int(rng.choice((0, 1, 2, 3, 1000 if f.type != F.TYPE_STRING else 100)))
            target.extend(_scalar(rng, f, ctx) for _ in range(count))
        return
    if f.type == F.TYPE_MESSAGE:
        target.CopyFrom(random_message(rng, f.message_type, ctx, depth + 1))
        return
    setattr(msg, f.name, _scalar(rng, f, ctx))


def random_message(rng: np.random.Generator, desc: Descriptor, ctx: Context, depth: int = 0) -> Any:
    """A message of type ``desc`` with random fields (nested messages up to depth 3)."""
    msg = _message(desc)
    for f in desc.fields:
        if f.type == F.TYPE_MESSAGE and depth >= 3:
            continue
        if rng.random() < 0.5:
            _set(rng, msg, f, ctx, depth)
    return msg


def _fields(msg: Any, depth: int = 0) -> list[tuple[Any, FieldDescriptor, int]]:
    """Every (message, field, depth) a mutation may change, nested set messages included."""
    out = []
    for f in msg.DESCRIPTOR.fields:
        out.append((msg, f, depth))
        if _is_map(f) or f.type != F.TYPE_MESSAGE or depth >= 3:
            continue
        if f.is_repeated:
            for entry in getattr(msg, f.name):
                out += _fields(entry, depth + 1)
        elif msg.HasField(f.name):
            out += _fields(getattr(msg, f.name), depth + 1)
    return out


def mutate(rng: np.random.Generator, msg: Any, ctx: Context, count: int) -> None:
    """Gives ``count`` random fields (at any depth) of ``msg`` random values."""
    for _ in range(count):
        candidates = _fields(msg)
        owner, f, depth = candidates[int(rng.integers(len(candidates)))]
        _set(rng, owner, f, ctx, depth)


def fit_payload(rng: np.random.Generator, msg: Any) -> None:
    """A tensor message (header.chunk + data): a payload of the size its chunk says, if small."""
    if "header" not in msg.DESCRIPTOR.fields_by_name or "data" not in msg.DESCRIPTOR.fields_by_name:
        return
    chunk = msg.header.chunk
    if chunk.numel <= 16384:
        known = chunk.dtype in ITEMSIZE
        msg.data = _payload(rng, chunk.dtype, chunk.numel) if known else b"\x00" * 4 * chunk.numel


def _manifest(rng: np.random.Generator, ctx: Context, job: str, tag: str) -> str:
    """The real manifest of decoy-a's snapshot d0, renamed, often with one entry (at any
    depth: a buffer's optimizer, a shard's size) removed or given a value of another kind."""
    m = json.loads(json.dumps(ctx.manifest))
    m["job"], m["tag"] = job, tag
    if rng.random() < 0.7:
        places = list(_places(m))
        owner, key = places[int(rng.integers(len(places)))]
        values = (None, -1, 2**64, 10**400, "x", [], {}, 1.5, 1e308, "../../x")
        if rng.random() < 0.3 and isinstance(owner, dict):
            del owner[key]
        else:
            owner[key] = values[int(rng.integers(len(values)))]
    return json.dumps(m)


def _places(node: Any) -> Any:
    """Every (container, key or index) inside a parsed JSON value."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        yield node, key
        if isinstance(value, (dict, list)):
            yield from _places(value)


def replica_blob(job: str, version: int) -> bytes:
    """A well-formed replica of server 0's slice of buffer "w" of ``job`` (values zero)."""
    spec = pb.RegisterBufferRequest(
        ref=pb.BufferRef(job=job, buffer="w"),
        numel=N,
        num_servers=1,
        contributors=1,
        optimizer=pb.OptimizerSpec(name="adam", hyper={"lr": 0.01}),
    )
    captured = [Captured("w", 0, np.zeros(N, np.float32), {}, 0)]
    return encode_shard(job, "replica", 0, 1, version, captured, {"w": spec.SerializeToString()})


def valid_request(rng: np.random.Generator, name: str, job: str, ctx: Context) -> Any | None:
    """A well-formed request of Shard method ``name`` for ``job``; None without a template."""
    version = ctx.versions.get(job, 2)
    ref = pb.BufferRef(job=job, buffer=str(rng.choice(["w", "w", "w", "v", "x"])))
    n = int(rng.choice((1, 7, 16, N)))
    chunk = pb.Chunk(offset=0, numel=n, dtype=pb.FLOAT32)
    data = _payload(rng, pb.FLOAT32, n)
    key = f"fz{rng.integers(4)}/all_reduce/{rng.integers(3)}"
    tag = str(rng.choice(["baseline", "latest", "d0", f"fz-{ctx.tags}"]))
    ctx.tags += 1
    args = pb.StepArgs(hyper={"lr": 0.01}, clip_coef=1.0)
    make: dict[str, Callable[[], Any]] = {
        "RegisterBuffer": lambda: pb.RegisterBufferRequest(
            ref=ref,
            numel=N,
            num_servers=1,
            contributors=1,
            params=[
                pb.ParamEntry(name="a", shape=[8, 4], dtype="float32", offset=0, numel=32),
                pb.ParamEntry(name="b", shape=[32], dtype="float32", offset=32, numel=32),
            ],
            optimizer=pb.OptimizerSpec(name="adam", hyper={"lr": 0.01}),
        ),
        "SetParams": lambda: pb.SetParamsRequest(
            header=pb.SetParamsHeader(
                ref=ref, chunk=chunk, version=version, state=str(rng.choice(["", "exp_avg"]))
            ),
            data=data,
        ),
        "PushGrad": lambda: pb.PushGradRequest(
            header=pb.PushGradHeader(
                ref=ref,
                chunk=chunk,
                step=version,
                num_micro=1,
                step_args=args if rng.random() < 0.5 else None,
            ),
            data=data,
        ),
        "PullParams": lambda: pb.PullParamsRequest(
            ref=ref, min_version=version, chunk=chunk, state=str(rng.choice(["", "exp_avg"]))
        ),
        "GradNorm": lambda: pb.GradNormRequest(job=job, buffers=["w"], step=version),
        "Step": lambda: pb.StepRequest(
            job=job, step=version, buffers=[pb.BufferStep(buffer="w", args=args)]
        ),
        "Contribute": lambda: pb.ContributeRequest(
            header=pb.SlotHeader(
                key=key, expected=1, readers=1, total_numel=n, chunk=chunk, chunk_numel=n
            ),
            data=data,
        ),
        "ReadSlot": lambda: pb.ReadSlotRequest(key=key),
        "DropJob": lambda: pb.DropJobRequest(job=job),
        "Status": lambda: pb.StatusRequest(pending=bool(rng.integers(2))),
        "Snapshot": lambda: pb.SnapshotRequest(
            job=job, tag=tag, version=version, server_index=0, num_servers=1
        ),
        "CommitSnapshot": lambda: pb.CommitSnapshotRequest(
            job=job, tag=tag, manifest_json=_manifest(rng, ctx, job, tag) if ctx.manifest else ""
        ),
        "Restore": lambda: pb.RestoreRequest(
            job=job, tag=tag, server_index=0, num_servers=1, check_only=bool(rng.integers(2))
        ),
        "ListSnapshots": lambda: pb.ListSnapshotsRequest(job=job),
        "ConfigureReplication": lambda: pb.ReplicationConfig(
            job=job, every=1, neighbour=ctx.address, server_index=0, num_servers=1
        ),
        "StoreReplica": lambda: _replica_chunk(rng, job, version),
        "ListReplicas": lambda: pb.ListReplicasRequest(job=job),
        "FetchReplica": lambda: pb.FetchReplicaRequest(job=job, version=version, max_bytes=4096),
        "LoadReplica": lambda: _replica_chunk(rng, job, version),
        "RollbackToReplica": lambda: pb.RollbackRequest(job=job, version=version),
        "Join": lambda: pb.JoinRequest(
            run="fz",
            job=job,
            rank=int(rng.integers(2)),
            world_size=2,
            step=version,
            min_members=1,
            window_ms=int(rng.choice((0, 50))),
            leave=bool(rng.random() < 0.2),
            recovery=bool(rng.random() < 0.2),
        ),
    }
    return make[name]() if name in make else None


def _replica_chunk(rng: np.random.Generator, job: str, version: int) -> pb.ReplicaChunk:
    blob = replica_blob(job, version)
    if rng.random() < 0.5:  # the whole replica in one chunk
        return pb.ReplicaChunk(job=job, version=version, total=len(blob), data=blob)
    start = int(rng.integers(len(blob)))
    end = int(rng.integers(start, len(blob) + 1))
    return pb.ReplicaChunk(
        job=job, version=version, offset=start, total=len(blob), data=blob[start:end]
    )


def garbage(rng: np.random.Generator, valid: bytes) -> bytes:
    """Bytes that are not the well-formed request ``valid`` (usually not well-formed at all)."""
    kind = int(rng.integers(9))
    if kind == 0:
        return rng.bytes(int(rng.integers(1, 513)))
    if kind == 1 and valid:
        return valid[: int(rng.integers(len(valid)))]
    if kind == 2 and valid:
        out = bytearray(valid)
        for _ in range(int(rng.integers(1, 9))):
            out[int(rng.integers(len(out)))] ^= 1 << int(rng.integers(8))
        return bytes(out)
    if kind == 3:
        return valid + rng.bytes(int(rng.integers(1, 33)))
    if kind == 4:
        return b"\xff" * int(rng.integers(1, 12))
    if kind == 5:  # a length-delimited field that claims far more bytes than follow
        tag = int(rng.choice((0x0A, 0x12, 0x7A, 0x5A)))
        return bytes([tag]) + b"\xff\xff\xff\xff\xff\xff\xff\xff\x7f" + b"abc"
    if kind == 6:  # wire types 6 and 7 do not exist; field number 0 neither
        return bytes([int(rng.choice((0x0E, 0x0F, 0x00, 0x07))), 0x01])
    if kind == 7:  # groups nested far deeper than any parser's recursion limit
        depth = int(rng.choice((50, 200, 2000)))
        return b"\x0b" * depth + b"\x0c" * depth
    return b"\x0a\x02\xff\xfe"  # field 1 as a string of invalid UTF-8


@dataclass
class FuzzRequest:
    """One fuzzed call: method, caller role, request bytes (one or more for streams)."""

    method: Method
    role: str
    payloads: list[bytes]
    kind: str  # template | random | garbage
    job: str | None  # the job a template targets


def make_request(
    rng: np.random.Generator,
    method: Method,
    role: str,
    job: str,
    ctx: Context,
    redirect_to: str | None = None,
) -> FuzzRequest:
    """A fuzzed request of ``method`` for ``job`` (a template's target; random fields may name
    any job). ``redirect_to``: every ``job`` field naming GUARDED names this job instead."""
    template = None
    if method.service == "paramshard.v1.Shard":
        template = valid_request(rng, method.name, job, ctx)
    draw = rng.random()
    if template is not None and draw < 0.7:
        kind, msg = "template", template
        mutations = int(rng.choice((0, 1, 1, 2, 3)))
        mutate(rng, msg, ctx, mutations)
        if mutations and rng.random() < 0.5:
            fit_payload(rng, msg)
    elif draw < 0.85:
        kind, msg = "random", random_message(rng, method.request, ctx)
        if rng.random() < 0.5:
            fit_payload(rng, msg)
    else:
        kind = "garbage"
        msg = template if template is not None else random_message(rng, method.request, ctx)
    if msg.ByteSize() > MAX_REQUEST:  # nested repeated fields multiply: keep requests small
        msg.Clear()
        kind = "random"
    if redirect_to is not None:
        _rename_job(msg, GUARDED, redirect_to)
    count = int(rng.integers(1, 4)) if method.client_streaming else 1
    payloads = [msg.SerializeToString() for _ in range(count)]
    if kind == "garbage":
        payloads = [garbage(rng, p) for p in payloads]
    return FuzzRequest(method, role, payloads, kind, job if kind == "template" else None)


def _rename_job(msg: Any, away: str, to: str) -> None:
    """Every ``job`` field of ``msg`` (at any depth) naming ``away`` names ``to`` instead."""
    for owner, f, _ in _fields(msg, depth=-10):
        if f.name == "job" and f.type == F.TYPE_STRING and not f.is_repeated:
            if getattr(owner, f.name) == away:
                setattr(owner, f.name, to)
