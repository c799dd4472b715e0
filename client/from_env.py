"""The client of a rank's configurations built from the launcher's environment: one per
process for one run, rank and set of servers, as torch's models share the default process
group.

A script with two models (a GAN's generator and discriminator, a teacher beside its student,
an evaluation copy) builds two configurations with ``ShardingConfiguration.from_env``. Each
built its own client: both numbered their collectives from 1 under the same run id, so the
second model's first broadcast met the first model's slot, freed ("this process is behind the
other ranks' collectives"), or, while it was still open, its values. One client numbers the
collectives of both, in the order the script makes them, the same on every rank; its leases
are held once. It is shared while a configuration holds it and until it is closed (close it
once, at the end).
"""

from __future__ import annotations

import os
import threading
import weakref

from paramshard.client.cluster import ClusterSpec
from paramshard.client.shard_client import ShardClient

__all__ = ["client_from_env"]

_ENV = (
    "PARAMSHARD_SERVERS",
    "PARAMSHARD_TOKEN",
    "PARAMSHARD_TLS_CA",
    "PARAMSHARD_TLS_CERT",
    "PARAMSHARD_TLS_KEY",
    "PARAMSHARD_TLS_SERVER_NAME",
)
"""What ``ClusterSpec.from_env`` reads: another value is another client."""
_SHARED: weakref.WeakValueDictionary[tuple, ShardClient] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def client_from_env(rank: int, world_size: int, run_id: str) -> ShardClient:
    """Rank ``rank`` of ``world_size`` in run ``run_id`` on the environment's servers: the
    client this process already has for them, if one is open, else a new one."""
    key = (rank, world_size, run_id, *(os.environ.get(v) for v in _ENV))
    with _LOCK:
        client = _SHARED.get(key)
        if client is None or client.closed:
            client = ShardClient(
                ClusterSpec.from_env(), rank=rank, world_size=world_size, run_id=run_id
            )
            _SHARED[key] = client
        return client
