"""What a server sends its neighbour instead of its ``peer`` token: a credential derived from
the token for one job and a few minutes, so the token itself never leaves the server.

Replication goes to the address an ``admin`` call names (``ConfigureReplication``), and the
first thing the server sends there is a call with its peer credential. Were that credential
the peer token, anyone allowed to turn on replication of a job of theirs could name a port of
their own and read the token, and with it store replicas of every job on every server (peer
tokens take no scope). A derived credential is worth one job, the one the caller was already
allowed to configure, for ``VALID_S`` seconds::

    peer1.<job, UTF-8 as hex>.<unix seconds>.<HMAC-SHA256(peer token, TAG job NUL seconds), hex>

The neighbour holds the same peer token (the same ``peer TOKEN`` line on every server),
recomputes the HMAC and grants the ``peer`` role scoped to exactly that job: ``StoreReplica``
of that job, and the shared-segment calls, whose segments belong to ``OWNER`` as they belonged
to the one peer token before. Servers' clocks must agree within ``VALID_S``.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable

__all__ = ["OWNER", "PREFIX", "VALID_S", "derive", "is_derived", "verify"]

PREFIX = "peer1."
VALID_S = 300.0
"""How far a credential's time may lie from the receiver's clock, either way."""
OWNER = "peer-credential"
"""Who owns the shared segments a derived credential offers (shm: segments belong to their
caller): every server's, as the peer token they all send made them before."""
_TAG = b"paramshard peer credential\0"


def _mac(peer_token: str, job: str, seconds: int) -> str:
    message = _TAG + job.encode("utf-8") + b"\0" + str(seconds).encode()
    return hmac.new(peer_token.encode("utf-8"), message, hashlib.sha256).hexdigest()


def derive(peer_token: str, job: str, now: float | None = None) -> str:
    """The credential for calls about ``job`` at time ``now`` (default: the clock)."""
    seconds = int(time.time() if now is None else now)
    return f"{PREFIX}{job.encode('utf-8').hex()}.{seconds}.{_mac(peer_token, job, seconds)}"


def is_derived(token: str) -> bool:
    return token.startswith(PREFIX)


def verify(
    peer_tokens: Iterable[str], credential: str, now: float | None = None
) -> tuple[str | None, str]:
    """(the job ``credential`` is good for, "") when one of ``peer_tokens`` made it within
    ``VALID_S`` of ``now``, else (None, why not)."""
    try:
        job_hex, seconds_text, mac = credential[len(PREFIX) :].split(".")
        job, seconds = bytes.fromhex(job_hex).decode("utf-8"), int(seconds_text)
    except ValueError:
        return None, "a peer credential that does not parse"
    matched = False
    for token in peer_tokens:  # no early exit: the time does not depend on which one matched
        matched |= hmac.compare_digest(_mac(token, job, seconds), mac)
    if not matched:
        return None, "a peer credential made with another peer token"
    skew = (time.time() if now is None else now) - seconds
    if abs(skew) > VALID_S:
        return None, (
            f"a peer credential {skew:+.0f} s old; servers' clocks must agree within {VALID_S:g} s"
        )
    return job, ""
