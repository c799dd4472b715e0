"""Reply bytes of unary calls that gRPC holds until their caller reads them.

A unary handler returns its reply and its thread is free again, but gRPC keeps the encoded
reply until the client's flow control lets it go. A client that never reads (a hand-written
HTTP/2 client, or one stopped) made a server keep every pull it asked for: eight pulls of a
256 MiB buffer by one read token grew a server by 8 GB, none of it in ``--max-memory``. So a
call counts the bytes its reply may carry (``ShardServicer.reply_bytes``: a pull's chunk, a
slot read's) from the moment it is admitted until gRPC ends the call, which it does only once
the reply left; one that would take a caller (a token) past half of ``MAX_BYTES``, or every
caller past all of it, is refused "retry later" (the client retries, client/retries.py). A
caller with nothing held always gets one call through, however large its reply. Sessions bound
their own replies (server/transport/session_bounds.py).
"""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["MAX_BYTES", "UnsentReplies"]

MAX_BYTES = 1024 * 2**20
"""Reply bytes of unary calls a server holds for its callers at once."""


class UnsentReplies:
    """The reply bytes each caller's admitted unary calls may still be holding."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self.total = 0
        self._by: Counter[str | None] = Counter()

    def take(self, caller: str | None, nbytes: int) -> str | None:
        """Counts ``nbytes`` for ``caller`` (None: no tokens); or why not ("retry later")."""
        share = self.max_bytes // 2
        with self._lock:
            mine = self._by[caller]
            if caller is not None and mine and mine + nbytes > share:
                return (
                    f"replies of {mine:,} bytes to this caller wait to be sent (read), half of"
                    f" what this server holds for unary replies ({self.max_bytes:,} bytes);"
                    " retry later"
                )
            if self.total and self.total + nbytes > self.max_bytes:
                return (
                    f"replies of {self.total:,} bytes wait to be sent (read), this server's"
                    " bound for unary replies; retry later"
                )
            self._by[caller] += nbytes
            self.total += nbytes
        return None

    def give(self, caller: str | None, nbytes: int) -> None:
        with self._lock:
            self.total -= nbytes
            self._by[caller] -= nbytes
            if not self._by[caller]:
                del self._by[caller]
