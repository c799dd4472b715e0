"""The launcher tells the servers that a rank ended for good once it exited with code 0.

A rank's own release at exit says whether it ends for good (``LeaseRequest.ends``,
client/restarts.py ``ends_for_good``), and it cannot always say so: under ``--max-restarts``
its exit hook cannot read the exit code (a ``sys.exit(1)`` is restarted), and a script that
closes its own client releases before its exit, not knowing how it will end. Its peers then
waited for a rank that had run out of batches until their deadline (120 s), and under
``--max-restarts`` a launcher restarted the healthy rank that gave up waiting, to wait again (a
field review: the job failed after 253 s where it fails in 0.6 s when the rank's exit says
so). The launcher sees the exit code, and never restarts a rank that exits 0
(paramshard/restarts.py), so it says so for every such rank of a fixed-world job: one ``Lease``
release with ``ends`` for the rank on every server, after the rank's own. A wait whose missing
ranks all ended then fails at once, naming them (uneven inputs). Likewise a rank that failed
and will not be restarted: the launcher posts the run's final notice for it (``tell_stopped``),
or its peers on other hosts would wait for its restart (``--max-restarts``) or, where its code
raised outside ``train_with_recovery`` (which tells them itself), until their deadline."""

from __future__ import annotations

import os
from collections.abc import Sequence

from paramshard.commands import cluster_spec

__all__ = ["TELL_S", "tell_ended", "tell_stopped"]

TELL_S = 5.0
"""How long the launcher spends telling every server, at most (a server that does not answer
leaves the rank's peers to their deadline, as before)."""


def tell_ended(
    addresses: Sequence[str], token: str | None, run_id: str, rank: int, world_size: int
) -> list[str]:
    """Tells each server that ``rank`` of ``run_id`` ended for good; returns what failed
    ("ADDRESS: CODE: details"), empty when every server took it."""
    return _tell(addresses, token, run=run_id, rank=rank, world_size=world_size, ends=True)


def tell_stopped(
    addresses: Sequence[str], token: str | None, run_id: str, rank: int, world_size: int, why: str
) -> list[str]:
    """Posts the run's final notice for ``rank``, which failed and will not be restarted
    (``why``: "failed with exit code 1: ..."), so that its peers on other hosts stop now
    instead of waiting for its restart (``PARAMSHARD_REJOIN_TIMEOUT_S``, 120 s by default)
    or their deadline; returns what failed, as ``tell_ended``."""
    why = why[:1000]  # a server takes reasons of 1,024 characters at most
    return _tell(
        addresses, token, run=run_id, rank=rank, world_size=world_size, abort=why, final=True
    )


def _tell(addresses: Sequence[str], token: str | None, **fields: object) -> list[str]:
    """One ``Lease`` release of the launcher's, with ``fields``, to every server."""
    from paramshard.client import lease_releases
    from paramshard.protos import shard_pb2 as pb

    spec = cluster_spec(",".join(addresses))  # TLS files from PARAMSHARD_TLS_* like the ranks
    if token:
        spec.token = token
    request = pb.LeaseRequest(release=True, holder=f"paramshard-launch:{os.getpid()}", **fields)
    try:
        return lease_releases.post(spec, request, TELL_S)
    finally:
        spec.close()
