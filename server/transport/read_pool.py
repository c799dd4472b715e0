"""The pool read tokens' shared segments come from (server/transport/shm.py).

A ``read`` token's segments take replies only (a pull, a slot read) and are not paid from the
server's memory budget, so no segment a reader holds ever refuses a trainer's buffer: they
come from this pool beside it, bounded as a whole, per token, and in count.
"""

from __future__ import annotations

from collections import Counter

from paramshard.server.runtime.errors import ShardError

__all__ = ["ReadPool", "READ_POOL_BYTES", "READ_SHARE_BYTES", "MAX_READ_SEGMENTS"]

READ_POOL_BYTES = 128 * 2**20
"""Read tokens' segments, all together (pages never touched cost them nothing); past it,
their replies go in-band."""
READ_SHARE_BYTES = READ_POOL_BYTES // 2
"""What one read token's segments may take of the pool: whatever one team's reader holds, a
second team's finds the other half (a third reads in-band until segments are released)."""
MAX_READ_SEGMENTS = 4  # per read token: a pull or two in flight through segments


class ReadPool:
    """The bytes of each read token's segments. No lock of its own: its caller's (the
    registry's) is held around every call."""

    def __init__(self) -> None:
        self._bytes_of: Counter[str] = Counter()

    def pay(self, owner: str, held: int, nbytes: int) -> None:
        """Takes ``nbytes`` for read token ``owner``, which holds ``held`` segments, or
        raises RESOURCE_EXHAUSTED saying which bound it would pass (nothing taken)."""
        own, pool = self._bytes_of[owner], sum(self._bytes_of.values())
        if (
            held >= MAX_READ_SEGMENTS
            or own + nbytes > READ_SHARE_BYTES
            or pool + nbytes > READ_POOL_BYTES
        ):
            raise ShardError.exhausted(
                f"read tokens' segments come from a pool of {READ_POOL_BYTES:,} bytes"
                f" ({pool:,} in use), at most {MAX_READ_SEGMENTS} segments and"
                f" {READ_SHARE_BYTES:,} bytes per token (this one holds {held}, {own:,} bytes);"
                f" a segment of {nbytes:,} bytes does not fit: replies go in-band"
            )
        self._bytes_of[owner] += nbytes

    def refund(self, owner: str, nbytes: int) -> None:
        self._bytes_of[owner] -= nbytes
        if not self._bytes_of[owner]:
            del self._bytes_of[owner]
