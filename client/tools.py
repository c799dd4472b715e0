"""Look into a running job and keep it: the functions behind the ``paramshard`` commands.

- ``client.jobs``: ``job_params``, ``get_param``, ``inspect`` (what the live servers hold);
- ``client.checkpoints``: ``snapshot``, ``restore``, ``list_snapshots``;
- ``client.snapshot_deletion``: ``delete_snapshot``, ``prune_snapshots``;
- ``client.drop``: ``drop`` (a job off every server);
- ``client.replicas``: neighbour replication (``configure_replication``,
  ``recover_from_replicas``);
- ``client.export``: ``export`` and the streaming safetensors writer.

None of them needs the model's code or torch: they work from the manifests the servers hold.
A job may live on some servers only (a 3D job's part on its data-parallel group's servers):
each function asks every server where a job is. A 3D job's base name (``<job>`` for its parts
``<job>.pp<s>.tp<t>``) stands for the whole model.
"""

from paramshard.client.checkpoints import list_snapshots, recovery_tag, restore, snapshot
from paramshard.client.drop import drop
from paramshard.client.export import export, export_dtype, whole_items, write_safetensors
from paramshard.client.jobs import ParamRef, get_param, inspect, job_params
from paramshard.client.replicas import configure_replication, recover_from_replicas
from paramshard.client.snapshot_deletion import delete_snapshot, prune_snapshots

__all__ = [
    "ParamRef",
    "job_params",
    "get_param",
    "inspect",
    "snapshot",
    "restore",
    "list_snapshots",
    "recovery_tag",
    "delete_snapshot",
    "prune_snapshots",
    "drop",
    "configure_replication",
    "recover_from_replicas",
    "export",
    "export_dtype",
    "whole_items",
    "write_safetensors",
]
