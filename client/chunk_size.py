"""How much payload one message carries unless a client is told (``chunk_bytes``)."""

from __future__ import annotations

__all__ = [
    "chunk_bytes_for", "default_chunk_bytes", "CHUNK_BUDGET_BYTES", "MAX_CHUNK_BYTES",
    "MAX_REPLY_BYTES", "MIN_CHUNK_BYTES",
]  # fmt: skip

CHUNK_BUDGET_BYTES = 16 * 2**20
"""What a client's default chunks to all its servers add up to (``default_chunk_bytes``)."""
MIN_CHUNK_BYTES = 2**20
"""The smallest default chunk (from 16 servers on a host): below it each call's CPU (0.3-0.6 ms
end to end) outweighs its bytes."""
MAX_CHUNK_BYTES = 64 * 2**20
"""The largest ``chunk_bytes`` a client takes: a chunk's reply must fit ``MAX_REPLY_BYTES``."""
MAX_REPLY_BYTES = 2 * MAX_CHUNK_BYTES
"""The largest reply a client receives (its channels' bound, client/cluster.py): a chunk, or a
Status or snapshot listing, with room. Unbounded, a lying server's one reply could take 2 GiB
of a client (protobuf's own bound), and a tool keeps 8 calls in flight."""


def chunk_bytes_for(given: int | None, servers_per_host: int) -> int:
    """A client's ``chunk_bytes``: ``given``, checked, or the default for its host."""
    if given is None:
        return default_chunk_bytes(servers_per_host)
    if not 1 <= given <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be 1..{MAX_CHUNK_BYTES:,} (64 MiB), got {given:,}")
    return given


def default_chunk_bytes(servers_per_host: int) -> int:
    """The size of one message's payload (``chunk_bytes``) unless a client is given one: the
    largest power of two at most ``CHUNK_BUDGET_BYTES / servers_per_host``, from
    ``MIN_CHUNK_BYTES`` to ``CHUNK_BUDGET_BYTES`` (``ClusterSpec.servers_per_host``: 4 servers
    on one host, 4 MiB, NCCL's default buffer; 8: 2 MiB; one a host: 16 MiB).

    Larger messages cost less CPU a byte, but a server maps about two segments of one chunk
    from each trainer of its host, and a trainer two of each server of its host
    (protos/shm.py); servers on other hosts map nothing. With a fixed chunk a server's
    segments grow with the ranks on its host: GPT-2 124M servers at W=8 on one host peaked
    at 1.31-1.44x the memory formula with 4 MiB chunks (2.22-2.36x with 16), all of the
    excess segments. Dividing a budget among a host's servers keeps a server's segments and
    a trainer's near 2 x 16 MiB however many share the host, and leaves messages between
    hosts, where nothing is mapped, at 16 MiB (docs/benchmarks.md, "Chunk size")."""
    share = CHUNK_BUDGET_BYTES // max(1, servers_per_host)
    return max(MIN_CHUNK_BYTES, min(CHUNK_BUDGET_BYTES, 1 << (max(1, share).bit_length() - 1)))
