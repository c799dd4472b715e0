"""What a server reports in its Status reply: the buffers it holds, its memory, what waits.

``status_reply`` answers the Status call (role ``read``, server/auth.py): device, memory
account, uptime, one row per job and buffer, and with ``StatusRequest.pending`` every open
slot, unread mailbox message and gradient step waiting for contributions (server/pending.py),
the oldest first and bounded in number.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from paramshard.protos import shard_pb2 as pb
from paramshard.server import backend
from paramshard.server.pending import pending_rows
from paramshard.server.store import BufferStore

if TYPE_CHECKING:
    from paramshard.server.servicer import ShardServicer

__all__ = ["job_status", "status_reply"]


def status_reply(servicer: ShardServicer, req: pb.StatusRequest, version: str) -> pb.StatusReply:
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
    )
    if req.pending:
        slices = [b for buffers in servicer.buffers.jobs().values() for b in buffers]
        rows, left_out = pending_rows(servicer.slots.open_slots(), slices, req.max_pending)
        reply.pending.extend(rows)
        reply.pending_left_out = left_out
    return reply


def job_status(store: BufferStore) -> list[pb.JobStatus]:
    """One row per job on this server, one per buffer slice in it (Status, snapshots)."""
    out = []
    for job, buffers in sorted(store.jobs().items()):
        rows = []
        for b in buffers:
            with b.cond:
                params, grads, opt = b.bytes_by_kind()
                rows.append(
                    pb.BufferStatus(
                        buffer=b.name,
                        numel=b.numel,
                        slice_start=b.start,
                        slice_numel=b.slice_numel,
                        dtype=str(b.dtype),
                        version=b.version,
                        initialized=b.initialized,
                        optimizer=b.optimizer.name,
                        param_bytes=params,
                        grad_bytes=grads,
                        optimizer_bytes=opt,
                        params=b.spec.params,
                        last_step_seconds=b.last_step_seconds,
                        last_step_unix=b.last_step_unix,
                        contributors=b.contributors,
                        hyper={k: float(v) for k, v in b.optimizer.hyper.items()},
                        state_keys=sorted(b.optimizer.state_arrays()),
                        optimizer_steps=b.optimizer.step_count,
                        skipped_steps=b.skipped_steps,
                    )
                )
        first = buffers[0].spec if buffers else None
        out.append(
            pb.JobStatus(
                job=job,
                buffers=rows,
                server_index=first.server_index if first else 0,
                num_servers=first.num_servers if first else 0,
                model_config=next(
                    (b.spec.model_config for b in buffers if b.spec.model_config), ""
                ),
            )
        )
    return out
