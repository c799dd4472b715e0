"""What a server reports about the buffers it holds: the rows of the Status reply."""

from __future__ import annotations

from protos import shard_pb2 as pb
from server.store import BufferStore

__all__ = ["job_status"]


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
                    )
                )
        first = buffers[0].spec if buffers else None
        out.append(
            pb.JobStatus(
                job=job,
                buffers=rows,
                server_index=first.server_index if first else 0,
                num_servers=first.num_servers if first else 0,
            )
        )
    return out
