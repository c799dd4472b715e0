"""What a call will do, peeked at before it runs, without locks: whether it may wait for
other callers (the admission gate, server/rpc/admission.py) and how many payload bytes its
reply may carry (sessions, server/transport/sessions.py)."""

from __future__ import annotations

from typing import Any

from paramshard.protos import codec
from paramshard.protos.batches import TENSOR_REPLIES
from paramshard.server.buffers.store import BufferStore
from paramshard.server.collectives.slots import SlotStore
from paramshard.server.rpc.parsers import Malformed
from paramshard.server.runtime.errors import ShardError

__all__ = ["may_wait", "reply_bytes"]


def may_wait(buffers: BufferStore, method: str, request: Any) -> bool:
    """Whether a call may wait for other callers (False: what it asks for is here now, or
    it fails at once). A peek without locks, for the admission gate
    (server/rpc/admission.py)."""
    if isinstance(request, Malformed):
        return False
    try:
        if method == "PullParams":
            b = buffers.get(request.ref.job, request.ref.buffer)
            return not (b.initialized and b.version >= request.min_version)
        if method == "PushGrad":  # waits only for the initial values (SetParams)
            header = request[0]
            b = buffers.get(header.ref.job, header.ref.buffer)
            return header.step == b.version and not b.initialized
        if method == "Step":  # waits for the other ranks' pushes
            slices = [buffers.get(request.job, s.buffer) for s in request.buffers]
            return any(b.step_would_wait(request.step) for b in slices)
        if method == "Join":  # waits for its step's membership; a leave does not
            return not request.leave
    except ShardError:
        return False  # no such buffer: it fails at once
    return True


def reply_bytes(slots: SlotStore, method: str, request: Any) -> int:
    """The payload bytes a call's reply may carry, known before it runs: sessions count
    them when they take the call (server/transport/sessions.py). 0 for a reply that
    goes into the caller's segment, and for methods whose replies carry no tensor."""
    if isinstance(request, Malformed) or method not in TENSOR_REPLIES:
        return 0
    if method == "ContributeRead":  # its own chunk, in the dtype it adds
        request = request[0]
    if method != "ReadSlot":
        try:
            size = request.chunk.numel * codec.numpy_dtype(request.chunk.dtype).itemsize
        except ValueError:
            return 0  # refused at once
    else:  # a slot with no contribution yet: counted once the reply exists
        size = slots.chunk_nbytes(request.key, request.offset) or 0
    if request.HasField("reply_shm") and size <= request.reply_shm.nbytes:
        return 0
    return size
