"""The snapshot manifest: what a snapshot holds, readable without the model's code or servers.

Written by the client that takes the snapshot (it alone sees every server's shard), read by
servers restoring it and by offline export.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any

__all__ = [
    "FORMAT",
    "MODEL_CONFIG_MAX_BYTES",
    "check_model_config",
    "new_manifest",
    "recorded_placement",
    "recorded_model_config",
    "recorded_parts",
    "restore_placement",
    "shard_name",
]

FORMAT = "paramshard-snapshot/1"

MODEL_CONFIG_MAX_BYTES = 1 << 20
"""Largest model description a server keeps (RegisterBufferRequest.model_config, UTF-8): a
Hugging Face config is a few KiB; this bounds what any client can make a server store."""
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_model_config(text: str) -> dict[str, Any]:
    """The model description ``text`` (JSON: {"architecture": class name, "config": object})
    parsed, or ValueError saying what is wrong with it."""
    size = len(text.encode())
    if size > MODEL_CONFIG_MAX_BYTES:
        raise ValueError(
            f"model_config is {size:,} bytes, over the limit of {MODEL_CONFIG_MAX_BYTES:,}"
        )
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"model_config is not JSON ({exc})") from None
    if not isinstance(value, dict) or not isinstance(value.get("config"), dict):
        raise ValueError('model_config must be a JSON object with a "config" object')
    architecture = value.get("architecture")
    if not isinstance(architecture, str) or not _CLASS_NAME.fullmatch(architecture):
        raise ValueError(f'model_config "architecture" must be a class name, got {architecture!r}')
    return value


def shard_name(index: int, num: int) -> str:
    """The file of shard ``index`` of a snapshot taken on ``num`` servers."""
    return f"shard-{index}-of-{num}.safetensors"


def new_manifest(
    job: str,
    tag: str,
    version: int,
    num_servers: int,
    buffers: dict[str, Any],
    shards: list[dict[str, Any]],
    servers: list[int] | None = None,
    cluster_servers: int | None = None,
    model_config: str = "",
) -> dict[str, Any]:
    """``buffers``: name -> {numel, contributors, optimizer: {name, hyper}, params: [entries]};
    ``shards``: [{file, server, bytes, sha256}] in slice order (``server`` is the slice's
    index); ``servers``: which server of the cluster (``cluster_servers`` of them) held each
    slice, so a restore into the same cluster puts every slice back where it was (default:
    slice i on server i); ``model_config``: the job's JobStatus.model_config, recorded as the
    object it holds when not empty."""
    manifest = {
        "format": FORMAT,
        "job": job,
        "tag": tag,
        "version": version,
        "num_servers": num_servers,
        "created_unix": time.time(),
        "buffers": buffers,
        "shards": shards,
        "servers": list(range(num_servers)) if servers is None else list(servers),
        "cluster_servers": num_servers if cluster_servers is None else cluster_servers,
    }
    if model_config:
        manifest["model_config"] = check_model_config(model_config)
    return manifest


def recorded_model_config(manifest: Mapping[str, Any]) -> str:
    """The model description a manifest recorded, as RegisterBufferRequest.model_config
    carries it (JSON text); "" when there is none."""
    value = manifest.get("model_config")
    return json.dumps(value, separators=(",", ":")) if value is not None else ""


def recorded_placement(manifest: dict[str, Any]) -> tuple[list[int], int]:
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


def restore_placement(manifest: dict[str, Any], cluster_size: int) -> list[int] | None:
    """Where a restore into a cluster of ``cluster_size`` servers puts the slices of a
    snapshot (a manifest, or a ListSnapshots row): back on the servers that held them when the
    cluster has the size it had (a restarted server gets its own slices back); None when it
    has another size, and the job is resharded over every server."""
    servers, cluster = recorded_placement(manifest)
    return servers if cluster == cluster_size else None


def recorded_parts(manifest: Mapping[str, Any]) -> list[str]:
    """Of a 3D job's part snapshot: every part its job had when it was taken
    (``{"hybrid": {"parts": [...]}}``, written by ``client.checkpoints``); [] otherwise."""
    hybrid = manifest.get("hybrid")
    parts = hybrid.get("parts") if isinstance(hybrid, Mapping) else None
    if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
        return []
    return list(parts)
