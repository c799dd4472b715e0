"""The bounds of one server's sessions (server/transport/sessions.py): calls in flight and
waiting, a batch's calls, unsent replies and held request bytes per session, bytes over all
sessions, and the sizes that decide how replies are batched and where a contribution runs.

At most ``MAX_CALLS`` calls of one session are in flight (queued, running, or replied
but not yet sent), ``MAX_WAITING`` of them calls that may wait (beyond either, the call is
refused "retry later", as a busy server refuses, but a Join answers at once without waiting:
``ANSWERS_AT_ONCE``, server/rpc/admission.py), at most ``MAX_BATCH`` calls in one batch
(beyond, the session ends with RESOURCE_EXHAUSTED, before the batch is parsed), and the
gate counts open sessions against ``CallLimits.max_sessions``. A call counts the bytes its
reply may carry from the moment it is taken (a pull's chunk, a read of an open slot's chunk:
``Sessions.reply_bytes``), and one that would take the session's replies, unsent or to come,
past ``MAX_UNSENT_BYTES`` is refused "retry later"; a read of a slot with no contribution yet
counts once its reply exists (``MAX_WAITING`` of them at most). A client that stops reading its
replies stops being read: past ``MAX_UNSENT`` replies or ``MAX_UNSENT_BYTES`` waiting to be
sent, the reader takes no more calls until they drain, and gRPC's flow control holds the
client's sends (refusals are replies too, so a caller cannot grow them without bound); so does
one whose calls hold ``MAX_HELD_BYTES`` of requests not yet run. Those bytes, over all the
server's sessions, have a bound too, ``SESSIONS_BYTES``: past it, a session holding its share
of it or more (the bound divided by the sessions open) takes no more calls until the total is
back under it. A greedy client holds itself back, never the trainers' small calls, which one
of them may wait for: the sessions under their share hold less than the bound between them,
so the total stays about twice the bound at most, plus, per session, a message and the
replies of the calls it has running. A small contribution runs on the session's reader
thread, as it never waits; any other call runs on a pool of the server's.
"""

from __future__ import annotations

from paramshard.protos.batches import MAX_BATCH

__all__ = [
    "MAX_CALLS",
    "MAX_WAITING",
    "MAX_BATCH",
    "MAX_UNSENT",
    "MAX_UNSENT_BYTES",
    "MAX_HELD_BYTES",
    "SESSIONS_BYTES",
    "BATCH_BYTES",
    "INLINE_BYTES",
]

MAX_CALLS = 256
"""Calls of one session in flight at once, replies not yet sent included: only a client that
does not read its replies reaches it (one keeps ``max_in_flight`` calls per batch)."""
MAX_WAITING = 64
"""Of them, calls that may wait for other callers (slot reads, pulls of a future version): a
contribution that would end their wait is never refused for them."""
MAX_UNSENT = 2 * MAX_CALLS
"""Replies waiting to be sent (refusals included) past which the reader stops taking calls."""
MAX_UNSENT_BYTES = 256 * 2**20
"""The same bound in reply bytes. A call counts the bytes its reply may carry from the moment
it is taken (``Sessions.reply_bytes``: a pull's chunk, a read of an open slot's chunk), and one
that would take them past the bound is refused "retry later": a batch of pulls nobody reads
is bounded when it is taken, not once its replies exist."""
MAX_HELD_BYTES = 256 * 2**20
"""Request bytes of the calls taken and not yet run to their end past which the reader takes
no more (one batch more at most: the server's largest message)."""
SESSIONS_BYTES = 1024 * 2**20
"""Request bytes held and reply bytes unsent, over all the sessions of a server, past which a
session holding its share of them or more is not read."""
BATCH_BYTES = 4 * 2**20
"""Replies ready together go in one batch up to this many bytes (gRPC's default receive
bound: a client with its defaults can read every batch but one holding a larger reply)."""
INLINE_BYTES = 256 * 2**10
"""A contribution up to this size runs on the reader thread (it never waits, and the add
costs less than handing it to another thread); a larger one on the pool."""
