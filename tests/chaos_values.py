"""What the chaos fuzzer's requests are made of (tests/test_chaos_fuzz.py): the jobs and runs it
guards or may change, the methods it calls (from the generated descriptors: the Shard service of
protos/shard_pb2.py, plus the open health and reflection services, so a method added to
shard.proto is fuzzed without a change here), the pools of values fields are drawn from, and
what the templates know of the server (tests/chaos_templates.py, tests/chaos_requests.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.descriptor import Descriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from paramshard.protos import shard_pb2 as pb
from paramshard.protos.batches import SESSION_METHODS

__all__ = [
    "GUARDED",
    "DECOYS",
    "N",
    "SESSION_METHODS",
    "run_of",
    "Method",
    "Context",
    "methods",
    "pick",
    "payload",
    "manifest",
]

GUARDED = "guarded"
"""The job the fuzzer must not change."""
DECOYS = ("decoy-a", "decoy-b")
"""Jobs that mutating calls with a role allowed to change them are sent to instead."""
N = 64  # elements of buffer "w" (adam); buffer "v" (sgd, float64 master) has 7


def run_of(job: str) -> str:
    """The run the templates use beside ``job``: ``guarded-run`` for the guarded job."""
    return f"{job}-run"


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
    run_of(GUARDED),
    f"{run_of(GUARDED)}:ar0/0",
    f"{run_of(DECOYS[0])}:ar0/0",
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
    segments: list[int] = field(default_factory=list)  # confirmed segments, of every caller

    def neighbours(self) -> tuple[str, ...]:
        """Replication targets a request may name: loopback addresses, and forms that name no
        host (no name a resolver would look up: the fuzzer reaches nothing beyond loopback)."""
        port = self.address.rsplit(":", 1)[1]
        others = ("127.0.0.1:1", "[::1]:1", "127.0.0.1:99999", "unix:/nonexistent", ":", "")
        return (self.address, f"localhost:{port}", *others)


def pick(rng: np.random.Generator, options: Any) -> Any:
    """One of ``options``, as it is (``rng.choice`` would turn 2**64 - 1 into a float)."""
    return options[int(rng.integers(len(options)))]


def payload(rng: np.random.Generator, dtype: int, numel: int) -> bytes:
    """``numel`` elements of wire dtype ``dtype``, sometimes not finite."""
    values = rng.standard_normal(numel)
    if numel and rng.random() < 0.1:
        values[rng.integers(numel)] = rng.choice([np.nan, np.inf, -np.inf])
    if dtype in (pb.FLOAT16, pb.BFLOAT16):
        return values.astype(np.float16).tobytes()
    wire = {pb.FLOAT64: np.float64, pb.INT64: np.int64, pb.INT32: np.int32}.get(dtype, np.float32)
    with np.errstate(invalid="ignore"):
        return values.astype(wire).tobytes()


def manifest(rng: np.random.Generator, ctx: Context, job: str, tag: str) -> str:
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
