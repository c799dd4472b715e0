"""Requests for the fuzz part of the chaos suite (tests/test_chaos_fuzz.py).

Every method comes from the generated descriptors (the Shard service of protos/shard_pb2.py,
plus the open health and reflection services), so a method added to shard.proto is fuzzed
without a change here. A request is one of:

- ``template``: a valid request for a known method (``valid_request``), then zero to three
  random field mutations (``mutate``): huge and negative-like numbers, empty, overlong and
  path-traversal strings, unknown dtypes and ops, shapes of 2**62, payloads whose size does
  not match the chunk, many repeated entries. Templates cover the job's run too (slot keys
  ``<run>:ar<seq>/0``, leases of its ranks: renewals with short TTLs, releases, aborts), the
  shared segments (offers of any size, confirmations and releases of the segments every
  caller holds, payloads and replies referencing them at any offset), and sessions (a batch
  of one to six templates of the data-plane methods, each mutated on its own);
- ``random``: every field drawn at random from the request type's descriptor (the only kind a
  method without a template gets, besides garbage);
- ``garbage``: bytes that are not a well-formed request (random, truncated, bit-flipped,
  unterminated varints, huge declared lengths, bad wire types, deep groups, invalid UTF-8).

Sizes are bounded (strings <= 4 KiB, payloads <= 64 KiB, repeated fields <= 1,000 scalars,
requests <= 1 MiB), so the fuzzer stays small, and the only address a request names is on
loopback (``neighbour``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from chaos_templates import valid_request
from chaos_values import (
    FLOATS,
    GUARDED,
    I32,
    I64,
    ITEMSIZE,
    MAX_REQUEST,
    SESSION_METHODS,
    STRINGS,
    U32,
    U64,
    Context,
    Method,
    manifest,
    payload,
    pick,
    run_of,
)
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from paramshard.protos import shard_pb2 as pb

__all__ = ["FuzzRequest", "make_request", "random_message", "mutate"]

F = FieldDescriptor


def _message(desc: Descriptor) -> Any:
    return message_factory.GetMessageClass(desc)()


def _bytes(rng: np.random.Generator) -> bytes:
    kind = rng.integers(6)
    if kind == 0:
        return b""
    if kind == 1:
        return rng.bytes(int(rng.integers(1, 65)))
    if kind == 2:
        return b"\x00" * int(rng.choice((3, 4096, 65536)))
    return payload(rng, int(rng.choice(list(ITEMSIZE))), int(rng.choice((1, 2, 63, 64, 65, 1000))))


def _scalar(rng: np.random.Generator, f: FieldDescriptor, ctx: Context) -> Any:
    """A random value of a scalar field (by name where the name says more than the type)."""
    if f.name == "neighbour":
        return pick(rng, ctx.neighbours())
    if f.name == "manifest_json" and ctx.manifest:
        return manifest(rng, ctx, GUARDED, "fz")
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


def fitpayload(rng: np.random.Generator, msg: Any) -> None:
    """A tensor message (header.chunk + data): a payload of the size its chunk says, if small."""
    if "header" not in msg.DESCRIPTOR.fields_by_name or "data" not in msg.DESCRIPTOR.fields_by_name:
        return
    chunk = msg.header.chunk
    if chunk.numel <= 16384:
        known = chunk.dtype in ITEMSIZE
        msg.data = payload(rng, chunk.dtype, chunk.numel) if known else b"\x00" * 4 * chunk.numel


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
    runs_to: str | None = None,
) -> FuzzRequest:
    """A fuzzed request of ``method`` for ``job`` and its run (a template's target; random
    fields may name any job). ``redirect_to``: every field naming GUARDED or its run names this
    job or its run instead; ``runs_to``: only the run is renamed so (a run's leases and slots
    cannot be restored the way a job is)."""
    if method.service == "paramshard.v1.Shard" and method.name == "Session":
        if rng.random() < 0.7:
            count = int(rng.integers(1, 4))
            payloads = [
                _session_batch(rng, job, ctx, redirect_to, runs_to, 8 * i) for i in range(count)
            ]
            return FuzzRequest(method, role, payloads, "template", job)
    template = None
    if method.service == "paramshard.v1.Shard":
        template = valid_request(rng, method.name, job, ctx)
    draw = rng.random()
    if template is not None and draw < 0.7:
        kind, msg = "template", template
        mutations = int(rng.choice((0, 1, 1, 2, 3)))
        mutate(rng, msg, ctx, mutations)
        if mutations and rng.random() < 0.5:
            fitpayload(rng, msg)
    elif draw < 0.85:
        kind, msg = "random", random_message(rng, method.request, ctx)
        if rng.random() < 0.5:
            fitpayload(rng, msg)
    else:
        kind = "garbage"
        msg = template if template is not None else random_message(rng, method.request, ctx)
    if msg.ByteSize() > MAX_REQUEST:  # nested repeated fields multiply: keep requests small
        msg.Clear()
        kind = "random"
    _redirect(msg, redirect_to, runs_to)
    count = int(rng.integers(1, 4)) if method.client_streaming else 1
    payloads = [msg.SerializeToString() for _ in range(count)]
    if kind == "garbage":
        payloads = [garbage(rng, p) for p in payloads]
    return FuzzRequest(method, role, payloads, kind, job if kind == "template" else None)


def _session_batch(
    rng: np.random.Generator,
    job: str,
    ctx: Context,
    redirect_to: str | None,
    runs_to: str | None,
    first_id: int,
) -> bytes:
    """A session's batch of one to six calls: templates of the data-plane methods, each
    mutated on its own, sometimes a method sessions do not carry or a meaningless deadline."""
    calls = []
    for i in range(int(rng.integers(1, 7))):
        name = str(pick(rng, SESSION_METHODS)) if rng.random() < 0.9 else str(pick(rng, STRINGS))
        msg = valid_request(rng, name, job, ctx) or pb.StatusRequest()
        mutate(rng, msg, ctx, int(rng.choice((0, 0, 1, 2))))
        if msg.ByteSize() > MAX_REQUEST // 8:
            msg.Clear()
        _redirect(msg, redirect_to, runs_to)
        timeout = float(pick(rng, (0.2, 0.2, 1.0, 0.0, -1.0, math.nan, math.inf, 1e300)))
        calls.append(pb.SessionCall(id=first_id + i, method=name, body=msg.SerializeToString(),
                                    timeout_s=timeout))  # fmt: skip
    return pb.SessionBatch(calls=calls).SerializeToString()


def _redirect(msg: Any, jobs_to: str | None, runs_to: str | None) -> None:
    """Every string field of ``msg`` (at any depth) naming GUARDED names ``jobs_to`` instead,
    and every one naming its run (a run, a slot key) names ``jobs_to``'s or ``runs_to``'s run."""
    run = run_of(GUARDED)
    to_run = runs_to or jobs_to
    for owner, f, _ in _fields(msg, depth=-10):
        if f.type != F.TYPE_STRING or f.is_repeated:
            continue
        value = getattr(owner, f.name)
        if jobs_to is not None and value == GUARDED:
            setattr(owner, f.name, jobs_to)
        elif to_run is not None and value.startswith(run):
            setattr(owner, f.name, run_of(to_run) + value[len(run) :])
