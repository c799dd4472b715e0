"""The snapshot manifest: what a snapshot holds, readable without the model's code or servers.

Written by the client that takes the snapshot (it alone sees every server's shard), read by
servers restoring it and by offline export.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["FORMAT", "new_manifest"]

FORMAT = "paramshard-snapshot/1"


def new_manifest(
    job: str,
    tag: str,
    version: int,
    num_servers: int,
    buffers: dict[str, Any],
    shards: list[dict[str, Any]],
) -> dict[str, Any]:
    """``buffers``: name -> {numel, contributors, optimizer: {name, hyper}, params: [entries]};
    ``shards``: [{file, server, bytes, sha256}] in server order."""
    return {
        "format": FORMAT,
        "job": job,
        "tag": tag,
        "version": version,
        "num_servers": num_servers,
        "created_unix": time.time(),
        "buffers": buffers,
        "shards": shards,
    }
