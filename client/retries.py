"""When a client asks again: which failures are retried, what marks a busy server's refusal,
and the jittered pauses between attempts, bounded by the call's deadline (client/rpc.py)."""

from __future__ import annotations

import random
import time
from typing import Any

import grpc

from paramshard.client.unreachable import DROPPED

__all__ = [
    "BUSY_MARK", "MIN_ATTEMPT_S", "RETRYABLE", "busy_pause", "freed_slot", "is_busy",
    "is_freed", "retry_pause",
]  # fmt: skip

RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
BUSY_MARK = "retry later"
"""In a RESOURCE_EXHAUSTED message, what says the server was busy (server/rpc/admission.py: too
many waiting calls at once), not out of memory or past a size limit, which is final."""


def is_busy(err: Any) -> bool:
    """Whether ``err`` (a ``ShardClientError``) is a server's "busy, retry later" refusal, or
    a call its gRPC dropped before any thread took it up (``unreachable.DROPPED``: more calls
    waited than ``--max-pending-calls``): nothing was done either way."""
    if err.code == grpc.StatusCode.CANCELLED:
        return DROPPED in err.details
    return err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and BUSY_MARK in err.details


MIN_ATTEMPT_S = 0.05
"""An attempt with less time than this before its call's deadline is not made."""


def retry_pause(attempt: int, deadline: float) -> float | None:
    """How long to wait before re-sending a call that failed with UNAVAILABLE (jittered,
    doubling from 50 ms to at most 2 s), or None when its ``deadline`` (monotonic) would leave
    the next attempt no time."""
    pause = min(2.0, 0.05 * 2**attempt) * (0.5 + random.random())
    if time.monotonic() + pause + MIN_ATTEMPT_S >= deadline:
        return None
    return pause


def busy_pause(refusals: int, deadline: float) -> float | None:
    """How long to wait before asking a busy server again (jittered, doubling from 20 ms to
    at most 1 s), or None when the call's ``deadline`` (monotonic) would pass first."""
    pause = min(1.0, 0.02 * 2**refusals) * (0.5 + random.random())
    if time.monotonic() + pause + 0.05 >= deadline:
        return None
    return pause


def is_freed(details: str) -> bool:
    """Whether a server's error says the slot or chunk a call named was read by all its
    readers and freed (server/collectives/slots.py)."""
    return "freed" in details


def freed_slot(method: str, code: Any, details: str, attempts: int) -> str:
    """What to add to a slot call's final error when its slot or chunk was found freed (read
    by every reader, this rank among them; a contribution is awaited from every contributor).

    - A retried read: the server served the first attempt (and counted this reader) before
      the connection broke, and once every reader had read, it freed the chunk: the reply
      was lost and the result is nowhere left for this rank.
    - A first attempt: this process did not make that collective before, the other ranks did,
      without it. It came to a running job and numbers its collectives afresh (a rank
      restarted alone: ``paramshard launch --max-restarts``), behind theirs.

    "" otherwise."""
    if code != grpc.StatusCode.NOT_FOUND or not is_freed(details):
        return ""
    if attempts > 1 and method in ("ContributeRead", "ReadSlot"):
        return (
            "; an earlier attempt was answered, but the broken connection lost its reply, and"
            " the chunk's other readers have read it since: this rank's copy of the result is"
            " gone and the collective cannot finish here (restart the job from its last"
            " snapshot or checkpoint)"
        )
    if attempts == 1 and method in ("Contribute", "ContributeRead", "ReadSlot"):
        return (
            "; this process is behind the other ranks' collectives: they finished this one"
            " before it came (a rank restarted alone numbers its collectives afresh). Every"
            " rank must go on in a new epoch with it: train_with_recovery does as it starts;"
            " a loop of its own makes no collectives (all_reduce, barrier, save_checkpoint)"
            " while a rank may be restarted"
        )
    return ""
