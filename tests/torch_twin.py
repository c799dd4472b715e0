"""torch.distributed twins: run ``fn(rank, world, *args)`` on ``world`` spawned processes joined
in a gloo process group on 127.0.0.1, the way torch's own data parallelism runs.

The float32 tests measure their bound on such a twin (tests/numerics.py ``assert_within_twin``):
torch's DistributedDataParallel reduces gradients in its own order, and how far that lands from
single-process training on the same model and data is what float32 round-off does there.

``fn`` must be a module-level function of an importable module (it is pickled by name); each
process runs one torch thread. Results come back in rank order.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Callable
from typing import Any

__all__ = ["run_gloo"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(job: tuple) -> Any:
    fn, rank, world, port, args = job
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
    )
    try:
        return fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 240.0) -> list:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each in its own process."""
    port = _free_port()
    ctx = mp.get_context("spawn")  # fork would copy this process's threads and gRPC state
    with ctx.Pool(world) as pool:
        # one job per worker: each blocks in init_process_group until all have joined
        pending = pool.map_async(
            _rank, [(fn, r, world, port, args) for r in range(world)], chunksize=1
        )
        return pending.get(timeout=timeout_s)
