"""Collectives carried out through the shard servers' reduction slots (docs/design.md §1).

- reduce-scatter: rank j's slice of the tensor (the slice rule over the ranks) is reduced on
  rank j's own server (``server_of``: j mod N), where only rank j reads it.
- all-reduce: part i of the tensor (the slice rule over the servers) is reduced on server i and
  read back by every rank; reads of chunk k overlap with contributions of chunk k+1.
- all-gather / broadcast / send: a SET slot (one contributor) read by the other ranks; a send
  goes to the receiver's own server, an all-gather contribution to the sender's.

A group's client (``ShardClient.subgroup``) has only its members' servers, so a group's
collectives stay on them.

Every rank must call the collectives in the same order (as with torch.distributed): each call
takes the next sequence number, and slot keys are ``<run>:<seq>/<part>``.

Sums and means are reduced in contributor order whatever order contributions arrive in, so a
result is bitwise reproducible (``deterministic``, the default); a client with
``deterministic = False`` asks the servers to add in arrival order (no staging memory).
Tensors keep their dtype end to end: float64 travels as float64.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from paramshard.client.retries import is_freed
from paramshard.client.rpc import Call, RpcCore, ShardClientError
from paramshard.client.slot_reads import read_whole
from paramshard.client.tensors import as_flat, is_torch
from paramshard.protos import codec, slicing
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.placement import rank_server

__all__ = ["Collectives", "REDUCE_OPS"]

SMALL_TENSOR_BYTES = 256 * 2**10  # all-reduces up to this size use one server
REDUCE_OPS = {"sum": pb.SUM, "mean": pb.MEAN, "max": pb.MAX, "min": pb.MIN}
_SUMS = (pb.SUM, pb.MEAN)  # the reductions whose result depends on the order of addition


def _freed_slot(err: ShardClientError) -> bool:
    """A retried contribution whose first attempt completed the slot (and everyone read it)."""
    return err.method == "Contribute" and is_freed(err.details)


class Collectives(RpcCore):
    rank: int
    world_size: int
    run_id: str
    rank_servers: list[int] | None
    deterministic: bool = True
    """Reduce in contributor order (bitwise reproducible); False: in arrival order. Groups
    made from this client (``subgroup``, ``on_servers``) copy it when made."""

    def server_of(self, rank: int) -> int:
        """The index, among this client's servers, of rank ``rank``'s own server: ``rank mod
        N``, or in a group (``ShardClient.subgroup``) that member's server. Mailboxes, and
        the slices a reduce-scatter hands out, are kept on the receiving rank's server."""
        return rank_server(rank, self.num_servers, self.rank_servers)

    def restart_collectives(self, epoch: int) -> None:
        """Starts collective numbering afresh under ``<run_id>.e<epoch>`` (the run id this
        client started with), after a failure left ranks at different sequence numbers. Every
        rank calls it with the same epoch."""
        base = self.__dict__.setdefault("_base_run_id", self.run_id)
        self.run_id = f"{base}.e{epoch}"
        self.run_state.advance(epoch)  # an abort notice of an earlier epoch no longer applies
        self._seq = 0
        self.__dict__.pop("_p2p_seq", None)

    def _next_key(self, kind: str) -> str:
        self._seq = getattr(self, "_seq", 0) + 1
        return f"{self.run_id}:{kind}{self._seq}"

    def _chunk_numel(self, dtype: str) -> int:
        return max(1, self.chunk_bytes // codec.numpy_dtype(codec.wire_dtype(dtype)).itemsize)

    def _contributions(
        self,
        server: int,
        key: str,
        arr: np.ndarray,
        dtype: str,
        op: int,
        expected: int,
        readers: int,
        shape: tuple[int, ...] = (),
        contributor: int | None = None,
        into: np.ndarray | None = None,
    ) -> Iterator[Call]:
        """Contribute calls of ``arr``'s chunks; with ``into``, ContributeRead calls, each
        storing its chunk's result there (this rank reads what it adds to)."""
        chunk_numel = self._chunk_numel(dtype)
        wire = codec.wire_dtype(dtype)
        for offset, numel in slicing.chunk_ranges(arr.size, chunk_numel):
            header = pb.SlotHeader(
                key=key,
                op=op,
                expected=expected,
                readers=readers,
                total_numel=arr.size,
                shape=shape,
                chunk=pb.Chunk(offset=offset, numel=numel, dtype=wire),
                contributor=self.rank if contributor is None else contributor,
                chunk_numel=chunk_numel,
                arrival_order=not self.deterministic and op in _SUMS,
            )
            payload = (header, arr[offset : offset + numel])
            if into is None:
                yield Call(server, "Contribute", payload, retry_ok=_freed_slot)
            else:
                store = _store_in(into, offset, numel)
                nbytes = numel * into.itemsize
                yield Call(server, "ContributeRead", payload, store, reply_bytes=nbytes)

    def _reads(self, server: int, key: str, out: np.ndarray, dtype: str) -> Iterator[Call]:
        for offset, numel in slicing.chunk_ranges(out.size, self._chunk_numel(dtype)):
            yield Call(
                server,
                "ReadSlot",
                pb.ReadSlotRequest(key=key, offset=offset, reader=self.rank),
                _store_in(out, offset, numel),
                reply_bytes=numel * out.itemsize,
            )

    # -- public collectives ----------------------------------------------------------------
    def all_reduce(self, x: Any, op: str = "sum", *, in_place: bool = False) -> Any:
        """Reduces ``x`` over all ranks; every rank gets the result (same type as ``x``).
        ``in_place``: the result lands in ``x``'s own memory (a NumPy array or a CPU tensor;
        a device tensor's host copy), no second buffer of its size: a chunk of it is
        overwritten only by the read of that chunk's sum, which completes after the server
        took this rank's contribution to it (a retry of that contribution is a duplicate).

        Each chunk is one ContributeRead call: this rank's contribution and the read of the
        chunk's result (server/collectives/contribute_read.py)."""
        code = self._op(op)
        flat = as_flat(x)
        key = self._next_key("ar")
        out = flat.array if in_place else np.empty_like(flat.array)
        n, calls = flat.array.size, []
        for piece in self._parts(n, flat.array.nbytes):
            a, b = piece.global_offset, piece.global_offset + piece.numel
            calls += self._contributions(
                piece.server,
                f"{key}/{piece.server}",
                flat.array[a:b],
                flat.dtype,
                code,
                self.world_size,
                self.world_size,
                into=out[a:b],
            )
        self.run(calls)
        return flat.wrap(out)

    def reduce_scatter(self, x: Any, op: str = "sum") -> Any:
        """Reduces ``x`` over all ranks and returns this rank's slice of the result (1-D):
        elements [start, stop) of ``slicing.slice_bounds(x.numel, world_size, rank)``. The
        other ranks' slices are contributions; this rank's own, last, ContributeRead calls
        (client/call_order.py: none waits before every contribution has gone)."""
        code = self._op(op)
        flat = as_flat(x)
        key = self._next_key("rs")
        calls: list[Call] = []
        w, me = self.world_size, self.rank
        out = np.empty(0, dtype=flat.array.dtype)
        for j in [*(j for j in range(w) if j != me), me]:
            a, b = slicing.slice_bounds(flat.array.size, w, j)
            if j == me:
                out = np.empty(b - a, dtype=flat.array.dtype)
            calls += self._contributions(
                self.server_of(j),
                f"{key}/{j}",
                flat.array[a:b],
                flat.dtype,
                code,
                w,
                1,
                into=out if j == me else None,
            )
        self.run(calls)
        return flat.wrap(out, (out.size,))

    def all_gather(self, x: Any) -> list[Any]:
        """Every rank's ``x``, in rank order (shapes may differ between ranks)."""
        flat = as_flat(x)
        key = self._next_key("ag")
        sends = []
        if self.world_size > 1:
            sends = list(
                self._contributions(
                    self.server_of(self.rank),
                    f"{key}/{self.rank}",
                    flat.array,
                    flat.dtype,
                    pb.SET,
                    1,
                    self.world_size - 1,
                    flat.shape,
                    contributor=0,
                )
            )
        others = [
            (self.server_of(j), f"{key}/{j}") for j in range(self.world_size) if j != self.rank
        ]
        wire = codec.wire_dtype(flat.dtype)  # most likely: every rank's x is like this one
        guess = (flat.array.size, wire, self._chunk_numel(flat.dtype))
        got = iter(read_whole(self.run, self.rank, others, sends, guess))
        out = []
        for j in range(self.world_size):
            if j == self.rank:
                out.append(flat.wrap(flat.array.copy()))
            else:
                arr, shape, _ = next(got)
                out.append(flat.wrap(arr, shape))
        return out

    def broadcast(self, x: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``x`` on every rank. Every rank passes a tensor of the same shape and
        dtype (as torch.distributed.broadcast); only src's values matter."""
        self._check_rank(src, "src")
        flat = as_flat(x)
        key = self._next_key("bc")
        n = flat.array.size
        if self.world_size == 1:
            return flat.wrap(flat.array.copy())
        out = flat.array.copy()
        calls = []
        for piece in slicing.pieces(n, self.num_servers, 0, n) or [slicing.SlicePiece(0, 0, 0, 0)]:
            a, b = piece.global_offset, piece.global_offset + piece.numel
            part_key = f"{key}/{piece.server}"
            if self.rank == src:
                calls += self._contributions(
                    piece.server,
                    part_key,
                    flat.array[a:b],
                    flat.dtype,
                    pb.SET,
                    1,
                    self.world_size - 1,
                    contributor=0,
                )
            else:
                calls += self._reads(piece.server, part_key, out[a:b], flat.dtype)
        self.run(calls)
        return flat.wrap(out)

    def _parts(self, n: int, nbytes: int) -> list[slicing.SlicePiece]:
        """Where an all-reduce of ``n`` elements goes: spread over every server by the slice
        rule, except a small tensor, which costs one round trip per rank on a single server
        (rotating with the sequence number, so small collectives spread out too)."""
        if nbytes <= SMALL_TENSOR_BYTES or n == 0:
            return [slicing.SlicePiece(self._seq % self.num_servers, 0, 0, n)]
        return slicing.pieces(n, self.num_servers, 0, n)

    def barrier(self) -> None:
        """Returns once every rank has entered the barrier."""
        self.all_reduce(np.zeros(1, dtype=np.int64))

    def send(self, x: Any, dst: int, tag: str = "", *, key: str | None = None) -> None:
        """Puts ``x`` in rank ``dst``'s mailbox on its server; returns once it is stored.
        Messages from one rank to another arrive in the order sent, per ``tag``: a tag is a
        separate queue (a pipeline's activations and gradients between the same two ranks).
        ``key``: the place ``send_key`` took for it earlier, so that several sends can travel
        at once, or in any order, and still arrive in the order their keys were taken."""
        self._check_rank(dst, "dst")
        flat = as_flat(x)
        key = key or self._p2p_key(self.rank, dst, "send", tag)
        self.run(
            self._contributions(
                self.server_of(dst),
                key,
                flat.array,
                flat.dtype,
                pb.SET,
                1,
                1,
                flat.shape,
                contributor=0,
            )
        )

    def send_key(self, dst: int, tag: str = "") -> str:
        """Takes the place of the next message to ``dst`` under ``tag``, for ``send(key=)``."""
        self._check_rank(dst, "dst")
        return self._p2p_key(self.rank, dst, "send", tag)

    def recv_key(self, src: int, tag: str = "") -> str:
        """Takes the place of the next message from ``src`` under ``tag``, for ``recv(key=)``."""
        self._check_rank(src, "src")
        return self._p2p_key(src, self.rank, "recv", tag)

    def recv(self, src: int, like: Any = None, tag: str = "", *, key: str | None = None) -> Any:
        """Takes the next tensor rank ``src`` sent to this rank with ``tag`` (waits for it), or
        with ``key`` the one ``recv_key`` named. The result is a torch tensor if ``like`` is
        one or torch is loaded and the sender sent bfloat16, else a NumPy array."""
        self._check_rank(src, "src")
        key = key or self._p2p_key(src, self.rank, "recv", tag)
        guess = int(getattr(like, "nbytes", 0))  # a hint only: no copy of a device tensor
        hint = min(guess, self.chunk_bytes)
        ((arr, shape, dtype),) = read_whole(
            self.run, self.rank, [(self.server_of(self.rank), key)], hint=hint
        )
        return _wrap_received(arr, shape, dtype, like)

    # -- helpers -----------------------------------------------------------------------------
    def _p2p_key(self, src: int, dst: int, side: str, tag: str = "") -> str:
        """The n-th message from src to dst under ``tag``; senders and receivers count
        separately, so a rank sending to itself takes the same keys on both sides."""
        counters = self.__dict__.setdefault("_p2p_seq", {})
        n = counters[(side, src, dst, tag)] = counters.get((side, src, dst, tag), 0) + 1
        return f"{self.run_id}:p2p{src}-{dst}{'.' + tag if tag else ''}/{n}"

    def _check_rank(self, r: int, what: str) -> None:
        if not 0 <= r < self.world_size:
            raise ValueError(f"{what}={r} is outside ranks 0..{self.world_size - 1}")

    @staticmethod
    def _op(op: str) -> int:
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {sorted(REDUCE_OPS)}, got {op!r}")
        return REDUCE_OPS[op]


def _store_in(out: np.ndarray, offset: int, numel: int) -> Any:
    """A slot read's ``on_result``: the chunk's elements into ``out[offset:offset+numel]``."""

    def store(reply: Any) -> None:
        header, data = reply
        if header.chunk.offset != offset:  # another chunk's values, or another slot's
            got = header.chunk.offset
            raise codec.BadReply(f"the read of offset {offset:,} got offset {got:,}")
        out[offset : offset + numel] = codec.values_of(data, out.dtype, numel)

    return store


def _wrap_received(arr: np.ndarray, shape: tuple, dtype: str, like: Any) -> Any:
    """The received elements in the sender's dtype (never converted), as a torch tensor on
    ``like``'s device when ``like`` is one (or for bfloat16), else as a NumPy array."""
    if dtype == "bfloat16" or (like is not None and is_torch(like)):
        import torch  # bfloat16 has no NumPy dtype

        t = torch.from_numpy(arr.view(np.int16) if dtype == "bfloat16" else arr)
        t = (t.view(torch.bfloat16) if dtype == "bfloat16" else t).reshape(shape)
        return t.to(like.device) if like is not None and is_torch(like) else t
    return arr.reshape(shape)
