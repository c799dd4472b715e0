"""Dropping a job from every server that holds it: ``paramshard drop`` and the copies a carry
loads (client/carry.py)."""

from __future__ import annotations

from paramshard.client.jobs import server_jobs
from paramshard.client.shard_client import ShardClient
from paramshard.client.tensor_parts import find_parts

__all__ = ["drop"]


def drop(client: ShardClient, job: str) -> list[str]:
    """Drops ``job`` and a 3D job's every part ``<job>.pp<s>.tp<t>`` (a name may have both:
    a data-parallel model that loaded a 3D snapshot beside its parts) from every server that
    holds them: parameters, optimizer state, pending contributions and replicas. Snapshots
    stay. Returns the server jobs dropped; KeyError when no server holds any."""
    held = server_jobs(client)
    names = [job] if job in held.status else []
    names += list(find_parts(job, held.jobs).values())
    if not names:
        raise held.not_found(job)
    for name in names:
        client.drop_job(name)
    return names
