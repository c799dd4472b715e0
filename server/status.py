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
from paramshard.server.rpc.scopes import Scope, run_of_key
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


def status_reply(
    servicer: Reporting, req: pb.StatusRequest, version: str, scope: Scope | None = None
) -> pb.StatusReply:
    """The Status reply of ``servicer``'s server (``version``: the paramshard version). For a
    token scoped to ``scope`` (server/rpc/scopes.py) it lists only the jobs, their elastic
    memberships and the pending work of the jobs and runs, in scope; the server-wide figures
    (device, memory account, slot bytes and count, uptime) stay, as they name no job."""
    memory = backend.device_memory()
    slot_bytes, open_slots = servicer.slots.usage()
    reply = pb.StatusReply(
        server_index=servicer.server_index,
        num_servers=servicer.num_servers,
        device=backend.device,
        device_memory_used=memory["used"],
        device_memory_total=memory["total"],
        uptime_seconds=time.time() - servicer.started,
        jobs=servicer.buffers.status(None if scope is None else scope.allows_job),
        slot_bytes=slot_bytes,
        open_slots=open_slots,
        version=version,
        pid=os.getpid(),
        memory_used=servicer.budget.used,
        memory_limit=servicer.budget.limit,
        memberships=[
            m for m in servicer.membership.status() if scope is None or scope.allows_job(m.job)
        ],
    )
    if req.pending:
        slices = [
            b
            for job, buffers in servicer.buffers.jobs().items()
            if scope is None or scope.allows_job(job)
            for b in buffers
        ]
        slots = [
            s
            for s in servicer.slots.open_slots()
            if scope is None or scope.allows_run(run_of_key(s.key))
        ]
        rows, left_out = pending_rows(slots, slices, req.max_pending)
        for row in rows:  # a collective's missing ranks, as the leases here know them (a step's
            # row says them itself: pending.step_row)
            if row.missing and row.kind != "push_grad":
                row.whereabouts = servicer.slots.news.whereabouts(row.run, list(row.missing))
        reply.pending.extend(rows)
        reply.pending_left_out = left_out
    return reply
