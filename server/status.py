"""What a server reports in its Status reply: the buffers it holds, its memory, what waits.

``status_reply`` answers the Status call (role ``read``, server/rpc/auth.py): device, memory
account, uptime, one row per job and buffer, and with ``StatusRequest.pending`` every open
slot, unread mailbox message and gradient step waiting for contributions
(server/collectives/pending.py), the oldest first and bounded in number.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

from paramshard.protos import shard_pb2 as pb
from paramshard.server.buffers.store import BufferStore
from paramshard.server.collectives.membership import MembershipTable
from paramshard.server.collectives.pending import pending_rows
from paramshard.server.collectives.slots import SlotStore
from paramshard.server.runtime import backend
from paramshard.server.runtime.limits import MemoryBudget

__all__ = ["Reporting", "status_reply"]


class Reporting(Protocol):
    """What a Status reply reads of a server (``ShardServicer`` has it)."""

    server_index: int
    num_servers: int
    started: float
    buffers: BufferStore
    slots: SlotStore
    membership: MembershipTable
    budget: MemoryBudget


def status_reply(servicer: Reporting, req: pb.StatusRequest, version: str) -> pb.StatusReply:
    """The Status reply of ``servicer``'s server (``version``: the paramshard version)."""
    memory = backend.device_memory()
    slot_bytes, open_slots = servicer.slots.usage()
    reply = pb.StatusReply(
        server_index=servicer.server_index,
        num_servers=servicer.num_servers,
        device=backend.device,
        device_memory_used=memory["used"],
        device_memory_total=memory["total"],
        uptime_seconds=time.time() - servicer.started,
        jobs=servicer.buffers.status(),
        slot_bytes=slot_bytes,
        open_slots=open_slots,
        version=version,
        pid=os.getpid(),
        memory_used=servicer.budget.used,
        memory_limit=servicer.budget.limit,
        memberships=servicer.membership.status(),
    )
    if req.pending:
        slices = [b for buffers in servicer.buffers.jobs().values() for b in buffers]
        rows, left_out = pending_rows(servicer.slots.open_slots(), slices, req.max_pending)
        reply.pending.extend(rows)
        reply.pending_left_out = left_out
    return reply
