"""ContributeRead: a contribution and the read of its chunk's result in one call.

An all-reduce's rank contributes to every chunk it reads, and read that way costs two calls a
chunk, each a message, a thread hand-off and a reply on both sides. As one call it is one of
each, and the server need not copy the contribution: the caller's request (its shared
segment, or its message) lives until the call returns, so a chunk's first contribution stays
where it is until the next one adds to it into a new array, which becomes the accumulator
(``SlotStore.contribute`` with ``hold``). A call that ends before that (a deadline, an aborted
run) copies it out first (``release_hold``). The result is the same, bit for bit: the same
additions of the same operands, in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.slots import SlotStore
from paramshard.server.runtime.errors import ShardError

__all__ = ["contribute_read"]


def contribute_read(
    slots: SlotStore,
    h: pb.SlotHeader,
    data: memoryview,
    timeout: float,
    hold: bool = True,
    wait_in: Callable[[], Callable[[], None]] | None = None,
) -> tuple[pb.SlotHeader, Any]:
    """``slots.contribute`` then ``slots.read`` of the same chunk, as reader
    ``h.contributor``, within one ``timeout``: the read's (header, payload).

    ``hold=False`` for a caller in this process (client/local_calls.py), whose ``data`` is its
    own array: a call it cancels goes on here, and that array may be written again meanwhile.
    ``wait_in()``: called when the result is not in yet, once the contribution is: the call
    takes a place among the server's waiting calls (server/rpc/admission.py) and gets how it
    leaves it, or past their bounds raises "retry later". The contribution goes in whatever
    the bounds, as a Contribute does (the other ranks' calls wait for it; a retry's is a
    duplicate): so calls that wait never hold back the ones they wait for."""
    if h.op == pb.SET:
        raise ShardError.invalid(
            f"slot '{h.key}': ContributeRead adds to a reduction; a SET slot's writer does not"
            " read it (Contribute, then ReadSlot by its readers)"
        )
    deadline = time.monotonic() + timeout
    slots.contribute(h, data, timeout, hold=hold)
    req = pb.ReadSlotRequest(key=h.key, offset=h.chunk.offset, reader=h.contributor)
    leave = None
    try:
        if wait_in is not None and not slots.complete(h.key, h.chunk.offset):
            leave = wait_in()
        return slots.read(req, max(0.0, deadline - time.monotonic()))
    finally:
        if leave is not None:
            leave()
        slots.release_hold(h)
