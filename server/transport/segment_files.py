"""The files behind a server's shared segments (server/transport/shm.py): the record of one,
making one, and how many the server's descriptor limit leaves room for."""

from __future__ import annotations

import mmap
import os
import resource
import time
from dataclasses import dataclass, field

from paramshard.protos.shm import MFD_ALLOW_SEALING, seal
from paramshard.server.runtime.errors import ShardError

__all__ = ["FD_RESERVE", "Segment", "create", "segment_bound"]

FD_RESERVE = 256
"""Descriptors left to connections, files and snapshots (``segment_bound``)."""


@dataclass
class Segment:
    """One segment the registry offered: whose, its file and mapping, how it was handed over."""

    owner: str
    nbytes: int
    fd: int
    map: mmap.mmap
    ticket: bytes
    proof: bytes
    created: float
    reader: bool  # a read token's: from the read pool, for replies only
    confirmed: bool = False
    handed: bool = False
    last_used: float = field(default_factory=time.monotonic)


def create(nbytes: int) -> tuple[int, mmap.mmap]:
    """A sealed memfd of ``nbytes`` and its mapping; ShardError (nothing left open) if the
    system refuses."""
    try:
        fd = os.memfd_create("paramshard-segment", os.MFD_CLOEXEC | MFD_ALLOW_SEALING)
    except OSError as exc:
        raise ShardError.exhausted(f"a shared segment of {nbytes:,} bytes: {exc}") from None
    try:
        os.ftruncate(fd, nbytes)
        try:
            seal(fd)  # before anyone else holds it: its size never changes
        except OSError as exc:
            raise ShardError.precondition(
                f"this server cannot seal a shared segment ({exc.strerror}); payloads stay in-band"
            ) from None
        return fd, mmap.mmap(fd, nbytes)
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, OSError):
            raise ShardError.exhausted(f"a shared segment of {nbytes:,} bytes: {exc}") from None
        raise


def segment_bound() -> int:
    """How many segments the server may hold, from its descriptor limit: each holds two (its
    memfd and the mapping's), and ``FD_RESERVE`` stay for connections, files and snapshots.
    Without the bound, 4 tokens' small segments took a server's 1,024 descriptors, and then
    new connections hung and the handover failed."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 128
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(16, (soft - FD_RESERVE) // 2)
