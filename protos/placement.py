"""Which server holds what: the one place that decides it (torch-free; client, CLI and
servers share it, as ``strategies/topology.py`` is the one place for the rank grid).

- A rank's own server (mailboxes, the slices a reduce-scatter hands out): ``rank_server``.
- Where server i's replica of a job lives (neighbour replication, docs/design.md §5.2):
  ``replica_holder``, the next server on the ring of the job's servers.
- A 3D job's server jobs, one per (pipeline stage, tensor rank): ``part_job`` names them
  ``<job>.pp<s>.tp<t>`` and ``parse_part_job`` reads such a name back.
- Where a restore puts a snapshot's slices: ``restore_servers`` (back on the servers that
  held them when the cluster has the size it had, else resharded over every server), from
  what the manifest recorded (``recorded_placement``).

Naming: a *slice* is what one server holds of a job (``protos.slicing``); a *server* is an
index in the cluster (or, for ``rank_server``, among a client's servers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "MAX_SERVERS",
    "rank_server",
    "replica_holder",
    "part_job",
    "parse_part_job",
    "recorded_placement",
    "restore_placement",
    "restore_servers",
    "restore_slice",
]

MAX_SERVERS = 65_536
"""Servers of one placement (RegisterBuffer, Snapshot, Restore, ``paramshard serve
--num-servers``)."""


def rank_server(rank: int, num_servers: int, rank_servers: Sequence[int] | None = None) -> int:
    """The own server of rank ``rank`` among ``num_servers``: ``rank mod num_servers``, or
    ``rank_servers[rank]`` in a group that lists each member's (``ShardClient.subgroup``)."""
    return rank % num_servers if rank_servers is None else rank_servers[rank]


def replica_holder(server: int, num_servers: int) -> int:
    """The server that keeps server ``server``'s replica of a job on ``num_servers`` servers:
    the next one on the ring, so losing any one server loses no slice."""
    return (server + 1) % num_servers


_PART = re.compile(r"(?P<base>.+)\.pp(?P<s>\d+)\.tp(?P<t>\d+)")


def part_job(base: str, stage: int, tensor_rank: int) -> str:
    """The server job of one (pipeline stage, tensor rank) of the 3D job ``base``."""
    return f"{base}.pp{stage}.tp{tensor_rank}"


def parse_part_job(name: str) -> tuple[str, int, int] | None:
    """(base, stage, tensor rank) of a part job's name; None for any other name."""
    m = _PART.fullmatch(name)
    if m is None:
        return None
    return m["base"], int(m["s"]), int(m["t"])


def recorded_placement(manifest: Mapping[str, Any]) -> tuple[list[int], int]:
    """(servers, cluster_servers) of a manifest: which server of the cluster held each slice.
    A manifest without them (older, or not written by us) reads as slice i on server i of
    ``num_servers``, as does one whose entries do not make sense."""
    n = manifest["num_servers"]
    servers, cluster = manifest.get("servers"), manifest.get("cluster_servers")
    if (
        isinstance(servers, list)
        and len(servers) == n
        and isinstance(cluster, int)
        and cluster < 2**32  # SnapshotInfo.cluster_servers is a uint32
        and all(isinstance(s, int) and 0 <= s < cluster for s in servers)
        and len(set(servers)) == n
    ):
        return servers, cluster
    return list(range(n)), n


def restore_placement(manifest: Mapping[str, Any], cluster_size: int) -> list[int] | None:
    """Where a restore into a cluster of ``cluster_size`` servers puts the slices of a
    snapshot (a manifest, or a ListSnapshots row): back on the servers that held them when the
    cluster has the size it had (a restarted server gets its own slices back); None when it
    has another size, and the job is resharded over every server."""
    servers, cluster = recorded_placement(manifest)
    return servers if cluster == cluster_size else None


def restore_servers(manifest: Mapping[str, Any], cluster_size: int) -> list[int]:
    """The servers of a cluster of ``cluster_size`` that a restore of ``manifest`` puts its
    slices on, in slice order: ``restore_placement``, or every server (resharded)."""
    home = restore_placement(manifest, cluster_size)
    return home if home is not None else list(range(cluster_size))


def restore_slice(
    manifest: Mapping[str, Any], cluster_size: int, server: int
) -> tuple[int, int] | None:
    """(slice index, number of slices) that server ``server`` of a cluster of
    ``cluster_size`` restores of ``manifest``; None when the restore puts no slice on it."""
    servers = restore_servers(manifest, cluster_size)
    return (servers.index(server), len(servers)) if server in servers else None
