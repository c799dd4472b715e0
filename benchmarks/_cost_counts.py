"""Messages and bytes of one collective and of one training step, per rank and per server, for
our parameter-server layout and for ring and tree all-reduce (benchmarks/cost_model.py).

Ours (client/collectives.py, client/buffers.py): W ranks, N = W x s servers (s per host).
- all-reduce of S bytes: the tensor is cut into N parts (one server, if S <= 256 KiB); each
  rank sends each part to its server and reads the part's sum back, in ``chunk``-byte
  messages, one call a chunk (ContributeRead: the contribution, and the sum in its reply):
  N x ceil(S / N / chunk) calls a rank; every server handles W of its part's. Runs before
  ContributeRead made two calls a chunk, a contribution and a read (``fused_reads``). On the
  wire, per host and direction: its rank's parts for other hosts' servers and its servers'
  replies to other hosts' ranks, 2 S (W - 1) / W, as a ring's. Copied: S into the rank's
  segments and S out, and on its server S of contributions (less the S / W that stays where
  its call brought it, ContributeRead's) and S of replies.
- reduce-scatter / push of S: the contributions only (S (W - 1) / W out of each host), and
  each rank reads S / W (a reduce-scatter in the calls of its own slice's contribution);
  all-gather / pull of S: S (W - 1) / W into each host.
- a training step: DDP all-reduces 4 Ψ bytes of gradient in buckets of ``bucket`` bytes;
  ZeRO-2 pushes them (buckets) and pulls 4 Ψ of parameters; FSDP pulls each unit twice
  (forward, backward) and pushes its gradient: 12 Ψ bytes a rank. ZeRO-2 and FSDP add two
  small calls per server and step (GradNorm, Step) and the servers' optimizer step over Ψ / N
  elements.

torch on gloo, one dense CPU tensor a rank (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp,
gloo/allreduce.cc and gloo/allgather.cc of pytorch/gloo; torch 2.3 and later):
- all-reduce of S: gloo's ring, in place, in segments of at most 1 MiB (``GLOO_SEGMENT``):
  n = ceil(S / 1 MiB) of them, at least 2 W, rounded up to a multiple of W, each of
  ceil(S / n) bytes rounded up to an element; the ring skips a segment that lies past the
  tensor's end, so e = ceil(S / that) of them carry bytes (e = n but for tensors of a few
  elements: 2 float32 at W = 2 are 4 segments, 2 of them empty). A rank sends 2 e (W - 1) / W
  segments on average (a reduce-scatter pass, then an all-gather pass; each rank sends every
  segment but one chunk's in each) and receives as many, 2 S (W - 1) / W bytes each way, and
  reduces S (W - 1) / W into its tensor. No copy beside the sockets'.
- all-gather (``all_gather_into_tensor`` of S in all): gloo's ring of 2 (W - 1) sends of half a
  rank's part, into a flat temporary torch allocates: the part copied in (S / W) and the whole
  copied out into the output (S).
- reduce-scatter (``reduce_scatter_tensor``): torch clones the input (S), all-reduces the clone
  as above and copies its rank's slice out (S / W): twice a reduce-scatter's bytes on the wire.
Every byte a host's process moves counts once (a socket's send or receive, a memcpy, a pass of
the reduction); every segment counts at both ends.

The predictions' ring all-reduce: gloo's messages and bytes as above, and 2 (W - 1) steps in
sequence (a ring's hops; its segments pipeline behind them). The tree (NCCL's double binary
tree): 2 log2(W) hops, pipelined, about 2 S bytes per host and direction, in segments of
gloo's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paramshard.client.chunk_size import default_chunk_bytes

SMALL = 256 * 2**10  # client/collectives.py SMALL_TENSOR_BYTES: one server
CHUNK_BEFORE = 16 * 2**20
"""The default chunk of runs whose JSON does not say (benchmarks.collectives before it wrote
``client.chunk_mib``): docs/scaling.md's fit was made with these."""
BUCKET = 25 * 2**20  # ShardingConfiguration.bucket_size_bytes


def cpu_s(costs: dict[str, float], messages: float, nbytes: float) -> float:
    """CPU seconds of ``messages`` messages moving ``nbytes`` bytes, at a fitted side's
    ``cpu_s_per_message`` and ``cpu_s_per_byte`` (benchmarks/cost_model.py)."""
    return costs["cpu_s_per_message"] * messages + costs["cpu_s_per_byte"] * nbytes


@dataclass(frozen=True)
class Traffic:
    """One operation's cost drivers for one rank (and its host's servers)."""

    messages: float  # messages this rank sends or reads (each handled by a server too)
    server_messages: float  # messages the busiest server handles
    wire_bytes: float  # bytes per host and direction over its link
    handled_bytes: float  # bytes this rank's process and its host's servers copy
    round_trips: float  # sequential round trips (latency terms)


def chunk_for(servers_per_host: int, chunk: int | None) -> int:
    """``chunk``, or what a client sends in one message unless told, with
    ``servers_per_host`` servers on each host (client/chunk_size.py)."""
    return chunk or default_chunk_bytes(servers_per_host)


def run_chunk(client: dict, w: int, by_world: str) -> int:
    """The chunk a benchmark run's clients sent with ``w`` servers on one host: the one its
    JSON names (``client.chunk_mib``), or the default it recorded per W (``client[by_world]``:
    ``chunk_mib_same_host`` of benchmarks.collectives, ``chunk_mib_by_world`` of
    benchmarks.scale), or the clients' default today."""
    mib = client.get("chunk_mib") or (client.get(by_world) or {}).get(str(w))
    return int(mib * 2**20) if mib else chunk_for(w, None)


def fused_reads(client: dict) -> bool:
    """Whether a benchmark run's clients read each chunk they contribute to in the same call
    (ContributeRead; ``client.contribute_read`` in its JSON). Runs before it do not say: they
    made two calls, a contribution and a read."""
    return bool(client.get("contribute_read"))


def _pieces(nbytes: float, n: int, chunk: int) -> float:
    """Messages to move ``nbytes`` cut into ``n`` parts of at most ``chunk`` bytes each."""
    if nbytes <= 0:
        return n
    return n * max(1, math.ceil(nbytes / n / chunk))


def all_reduce(
    nbytes: float, w: int, s: int = 1, chunk: int | None = None, fused: bool = True
) -> Traffic:
    chunk = chunk_for(s, chunk)
    n = 1 if nbytes <= SMALL else w * s
    per = _pieces(nbytes, n, chunk)
    wire = 2 * nbytes * (w - 1) / w  # the parts on other hosts' servers, out and back
    calls = 1 if fused else 2  # a chunk's: ContributeRead, or Contribute and ReadSlot
    server = calls * w * max(1, math.ceil(nbytes / n / chunk))
    handled = 4 * nbytes - (nbytes / w if fused else 0.0)  # a chunk's first stays in place
    return Traffic(calls * per, server, wire, handled, 2)


def push(nbytes: float, w: int, s: int = 1, chunk: int | None = None) -> Traffic:
    """A gradient push (a reduce-scatter with the sum kept on the servers)."""
    n = w * s
    chunk = chunk_for(s, chunk)
    per = _pieces(nbytes, n, chunk)
    return Traffic(per, w * max(1, math.ceil(nbytes / n / chunk)), nbytes * (w - 1) / w,
                   2 * nbytes, 1)  # fmt: skip


def pull(nbytes: float, w: int, s: int = 1, chunk: int | None = None) -> Traffic:
    """A parameter pull (an all-gather of what the servers hold)."""
    return push(nbytes, w, s, chunk)


GLOO_SEGMENT = 2**20  # gloo/allreduce.h kMaxSegmentSize: a ring all-reduce's largest send


def gloo_segments(nbytes: float, w: int, elem: int = 4) -> tuple[int, int]:
    """(segments gloo's ring all-reduce cuts ``nbytes`` of ``elem``-byte elements into among
    ``w`` ranks, those of them that hold bytes: the ring sends no empty one)."""
    n = max(math.ceil(nbytes / GLOO_SEGMENT), 2 * w)
    n = math.ceil(n / w) * w
    seg = math.ceil(math.ceil(nbytes / n) / elem) * elem
    return n, math.ceil(nbytes / seg) if seg else 0


def gloo_op(op: str, nbytes: float, w: int) -> Traffic:
    """One rank's (and host's) traffic of torch's op on gloo (see the module's docstring);
    its latency term is a ring's steps in sequence, 2 (W - 1)."""
    frac, steps = (w - 1) / w, 2 * (w - 1)
    if op == "all_gather":
        moved = 2 * nbytes * frac + nbytes / w + nbytes  # the ring; the part in, all out
        return Traffic(2 * steps, 0, nbytes * frac, moved, steps)  # a send a step
    sends = 2 * gloo_segments(nbytes, w)[1] * frac
    moved = 5 * nbytes * frac  # sent and received (2 S frac each), reduced (S frac)
    if op == "reduce_scatter":
        moved += nbytes + nbytes / w  # the clone, the slice out
    elif op != "all_reduce":
        raise ValueError(f"unknown op {op!r}")
    return Traffic(2 * sends, 0, 2 * nbytes * frac, moved, steps)


def tree_all_reduce(nbytes: float, w: int) -> Traffic:
    hops = 2 * math.ceil(math.log2(max(2, w)))
    segments = 2 * max(1, math.ceil(2 * nbytes / GLOO_SEGMENT))  # sent and received, as gloo's
    return Traffic(segments, 0, 2 * nbytes, 3 * nbytes, hops)


def _add(parts: list[Traffic]) -> Traffic:
    return Traffic(*(sum(getattr(p, f) for p in parts) for f in Traffic.__dataclass_fields__))


def step_traffic(
    strategy: str, psi: float, w: int, *, units: int = 12, s: int = 1, bucket: int = BUCKET,
    chunk: int | None = None, fused: bool = True,
) -> Traffic:  # fmt: skip
    """A training step's traffic for ``psi`` float32 parameters (``units``: FSDP's blocks;
    ``fused``: ``fused_reads``)."""
    grad = 4 * psi
    buckets = max(1, math.ceil(grad / bucket))
    if strategy == "ddp":
        return _add([all_reduce(grad / buckets, w, s, chunk, fused)] * buckets)
    small = Traffic(2 * w * s, 2 * w, 0, 0, 2)  # GradNorm and Step to every server
    if strategy == "zero2":
        return _add(
            [push(grad / buckets, w, s, chunk)] * buckets + [pull(grad, w, s, chunk), small]
        )
    if strategy == "fsdp":
        unit = grad / units
        return _add(
            [pull(unit, w, s, chunk)] * (2 * units) + [push(unit, w, s, chunk)] * units + [small]
        )
    if strategy == "ring":
        return _add([gloo_op("all_reduce", grad / buckets, w)] * buckets)  # gloo's ring
    if strategy == "tree":
        return _add([tree_all_reduce(grad / buckets, w)] * buckets)
    raise ValueError(f"unknown strategy {strategy!r}")


def op_counts(
    side: str, op: str, nbytes: float, w: int, chunk: int | None = None, fused: bool = True
) -> tuple[float, float, float]:
    """(messages one host handles; bytes one host's processes copy; bytes over one host's
    link each way) of one op with messages of at most ``chunk`` bytes (see the
    module's docstring). A host of ours runs a rank and a server: both ends of every message
    count (with W servers on one host, a rank and one server: its share). ``chunk``: None, a
    client's default with one server a host; ``fused``: ``fused_reads``."""
    k = max(1, math.ceil(nbytes / w / chunk_for(1, chunk)))
    frac = (w - 1) / w
    if side == "gloo":
        t = gloo_op(op, nbytes, w)
        return t.messages, t.handled_bytes, t.wire_bytes
    if op == "all_reduce":
        t = all_reduce(nbytes, w, chunk=chunk, fused=fused)
        return 2 * t.messages, t.handled_bytes, t.wire_bytes
    if op == "all_gather":
        return 2 * w * k, 2 * nbytes, nbytes * frac
    calls = w if fused else w + 1  # the own slice's read: in its contribution's call, or not
    return 2 * calls * k, 2 * nbytes + 2 * nbytes / w, nbytes * frac
