"""What ``paramshard launch`` tells each rank: torchrun's environment plus the cluster
(``rank_env``), and the OpenMP threads it sets when the user did not (``omp_threads``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["omp_threads", "rank_env"]


def omp_threads(base: dict[str, str], nproc: int) -> int | None:
    """The OMP_NUM_THREADS the ranks get when ``base`` has none and ``nproc`` > 1: this
    process's cores (its CPU affinity) divided among the ranks, at least 1. More intra-op
    threads than cores spin and wait for one another: a loaded machine runs them many times
    slower (docs/launch.md)."""
    if "OMP_NUM_THREADS" in base or nproc <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // nproc)


def rank_env(
    base: dict[str, str],
    *,
    rank: int,
    local_rank: int,
    nproc: int,
    node_rank: int,
    world_size: int,
    servers: Sequence[str],
    run_id: str,
    token: str | None = None,
) -> dict[str, str]:
    """The environment of one rank: ``base`` plus what torchrun sets plus the cluster.

    glibc's MALLOC_* settings are whatever ``base`` has: the servers' (server.MALLOC_ENV) trade a
    trainer's memory for speed, so a rank gets them only if the user set them."""
    env = dict(base)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK=str(node_rank),
        PARAMSHARD_SERVERS=",".join(servers),
        PARAMSHARD_RUN=run_id,
        PYTHONUNBUFFERED="1",  # lines reach us as they are printed, not when a buffer fills
    )
    if token:
        env["PARAMSHARD_TOKEN"] = token
    return env
