"""Bounds on what a request may ask a server to keep besides its arrays (whose bytes the memory
account pays for: limits.py): the names it stores and reports in every Status and metrics
scrape, the placements it slices by, and the versions it counts from. A request past one fails
with INVALID_ARGUMENT before anything changes.

A shared server's tenants must not reach each other through these: a 200 MB alias list grew a
server by gigabytes its memory account never saw and made every team's Status time out, and a
version set near uint64's end wrapped at the next step, after which Status failed with INTERNAL
for every token (tests/test_request_bounds.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from paramshard.protos.placement import MAX_SERVERS
from paramshard.protos.run_ids import MAX_EPOCH
from paramshard.protos.slicing import MAX_DIMS, is_shape_of
from paramshard.server.runtime.errors import ShardError

__all__ = [
    "MAX_ALIASES",
    "MAX_DIMS",
    "MAX_EPOCH",
    "MAX_KEY",
    "MAX_NAME",
    "MAX_PARAM_NAME",
    "MAX_SERVERS",
    "MAX_VERSION",
    "check_epoch",
    "check_key",
    "check_name",
    "check_placement",
    "check_shape",
    "check_version",
    "count_of",
]

MAX_NAME = 256
"""Characters of a job or buffer name, or of a run a Join names."""
MAX_KEY = 1024
"""Characters of a slot key (a run id, at most 256: protos/run_ids.py, a group, a collective's
number or a pipeline message's tag) or of the run a buffer is registered under (a run id with
its group's and restart's suffixes)."""
MAX_PARAM_NAME = 1024
"""Characters of a parameter's name or one of its aliases (Hugging Face models' are under 100)."""
MAX_ALIASES = 64
"""Other names of one parameter (tied weights: a language model's head ties one or two)."""
MAX_VERSION = 2**53
"""The highest version or optimizer step count a client may set (SetParams): exact in a double,
as metrics and JSON carry it, and steps of one apart from it never reach uint64's end."""


def check_name(
    value: str, what: str, method: str, *, empty: bool = False, most: int = MAX_NAME
) -> None:
    """``value`` is a name of 1..``most`` characters (0.. when ``empty``)."""
    if len(value) > most or (not value and not empty):
        low = 0 if empty else 1
        raise ShardError.invalid(
            f"{method}: a {what} name has {low}..{most:,} characters, got {len(value):,}"
        )


def check_key(key: str, method: str) -> None:
    """``key`` is a slot key of 1..``MAX_KEY`` characters."""
    if not key or len(key) > MAX_KEY:
        raise ShardError.invalid(
            f"{method}: a slot key has 1..{MAX_KEY:,} characters, got {len(key):,}"
        )


def check_placement(server_index: int, num_servers: int, method: str) -> None:
    """Shard ``server_index`` of ``num_servers`` (1..``MAX_SERVERS``)."""
    if not 1 <= num_servers <= MAX_SERVERS or server_index >= num_servers:
        raise ShardError.invalid(
            f"{method}: server_index {server_index} of {num_servers} servers is not a shard of"
            f" a placement of 1..{MAX_SERVERS:,} servers"
        )


def check_version(value: int, what: str, method: str) -> None:
    """``value`` is at most ``MAX_VERSION``."""
    if value > MAX_VERSION:
        raise ShardError.invalid(f"{method}: {what} {value:,} is over {MAX_VERSION:,} (2**53)")


def count_of(value: Any, what: str) -> int:
    """``value``, a version or a step count read from a file or a caller's bytes (a replica,
    a snapshot's shard): an int, not a bool (JSON's ``true`` passed as 1, and Status then
    ended INTERNAL), in 0..``MAX_VERSION``; ValueError naming ``what`` otherwise (the caller
    says whose bytes they were). Before, a shard's -1, 2.5 or "12" was taken as 0, 2, 12."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} {value!r:.40} is not an int >= 0")
    if value > MAX_VERSION:
        raise ValueError(f"{what} {value:,} is over {MAX_VERSION:,} (2**53)")
    return value


def check_epoch(value: int, method: str) -> None:
    """``value``, a run's collective epoch (one more each recovery), is at most
    ``MAX_EPOCH``: the clients move on from it by one, and the wire holds 32 bits."""
    if value > MAX_EPOCH:
        raise ShardError.invalid(f"{method}: epoch {value:,} is over {MAX_EPOCH:,} (2**24)")


def check_shape(shape: Sequence[int], numel: int, what: str) -> None:
    """``shape`` is one of ``numel`` elements (``slicing.is_shape_of``), or INVALID_ARGUMENT."""
    if not is_shape_of(shape, numel):
        raise ShardError.invalid(
            f"{what}: shape {list(shape[:8])}{' ...' if len(shape) > 8 else ''} ({len(shape):,}"
            f" dims) is not a shape of {numel:,} elements in at most {MAX_DIMS} dims"
        )
