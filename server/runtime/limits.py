"""The server-wide memory bound (docs/design.md §6.2): one account, reserved before allocating.

Every array a server keeps on behalf of a caller is paid for from one ``MemoryBudget`` before
it is allocated, and paid back when it is freed:

- ``buffers``: a registered slice's params, gradient accumulator and every optimizer-state
  array its optimizer may create (``buffers.slice_state.buffer_bytes``) and its record,
  reserved whole at registration (or restore), so a later step never allocates past the limit;
- ``staging``: gradient contributions kept aside until the rank-order sum reaches them
  (``slice_state.PendingStep``), values and records, which a ``train`` token with a large
  ``num_micro`` could otherwise grow without bound;
- ``slots``: reduction slots and mailboxes, their accumulators and staged contributions, and
  their records (``collectives.slot``);
- ``replicas``: replica chunks being received, and the replicas kept (received and own).
- ``shm``: shared-memory segments offered to clients on this host (server/transport/shm.py).
- ``snapshots``: the host copies a Snapshot writes, and the slices a Restore reads before it
  swaps them in (server/snapshot_calls.py), for as long as the call holds them.

A reservation past the limit fails with RESOURCE_EXHAUSTED naming what was asked, what is in
use and the limit, before anything changes. The check and the update happen under one lock, so
two calls can never both pass a check that only one of them fits.

The limit (``paramshard serve --max-memory``) defaults to 90% of this host's memory (the
container's, when a cgroup limit is lower), or of the device's memory on a GPU.
"""

from __future__ import annotations

import math
import os
import re
import threading

from paramshard.server.runtime import backend
from paramshard.server.runtime.errors import ShardError

__all__ = [
    "MemoryBudget",
    "KINDS",
    "parse_bytes",
    "host_memory",
    "default_total",
    "default_memory_limit",
    "DEFAULT_FRACTION",
]

KINDS = ("buffers", "staging", "slots", "replicas", "shm", "snapshots")
"""What the budget pays for (see the module docstring)."""
DEFAULT_FRACTION = 0.9
"""The default limit, as a fraction of the host's (or the device's) memory."""


class MemoryBudget:
    """Bytes reserved on this server, by kind, against one ``limit`` (0: no limit)."""

    def __init__(self, limit: int = 0) -> None:
        if limit < 0:
            raise ValueError(f"max_memory must be >= 0 bytes (0: no limit), got {limit}")
        self.limit = int(limit)
        self._lock = threading.Lock()
        self._by_kind = dict.fromkeys(KINDS, 0)

    @property
    def used(self) -> int:
        with self._lock:
            return sum(self._by_kind.values())

    def usage(self) -> dict[str, int]:
        """Bytes reserved now, by kind."""
        with self._lock:
            return dict(self._by_kind)

    def reserve(self, nbytes: int, kind: str, what: str) -> None:
        """Takes ``nbytes`` for ``kind`` or raises RESOURCE_EXHAUSTED (nothing taken);
        ``what`` names the request in the message."""
        nbytes = int(nbytes)
        with self._lock:
            used = sum(self._by_kind.values())
            if self.limit and used + nbytes > self.limit:
                raise ShardError.exhausted(
                    f"{what}: {nbytes:,} more bytes of {kind} would exceed this server's memory"
                    f" limit of {self.limit:,} bytes ({used:,} in use; --max-memory)"
                )
            self._by_kind[kind] += nbytes

    def release(self, nbytes: int, kind: str) -> None:
        """Gives back what ``reserve`` took."""
        with self._lock:
            self._by_kind[kind] -= int(nbytes)
            assert self._by_kind[kind] >= 0, f"{kind}: released more than was reserved"


_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10, "kb": 10**3, "kib": 2**10, "ki": 2**10,
    "m": 2**20, "mb": 10**6, "mib": 2**20, "mi": 2**20,
    "g": 2**30, "gb": 10**9, "gib": 2**30, "gi": 2**30,
    "t": 2**40, "tb": 10**12, "tib": 2**40, "ti": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*|%)\s*")


def parse_bytes(text: str | int, total: int | None = None) -> int:
    """``"8GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1000000"`` (bytes) or ``"50%"`` (of
    ``total``, default this host's or device's memory) as a number of bytes. KiB/MiB/GiB/TiB
    (and K/M/G/T) are powers of 1024, KB/MB/GB/TB powers of 1000."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a memory size must be >= 0 bytes, got {text}")
        return text
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or (unit not in _UNITS and unit != "%"):
        raise ValueError(
            f"memory size {text!r}: expected a number of bytes with an optional unit (KiB, MiB,"
            " GiB, TiB: powers of 1024; KB, MB, GB, TB: powers of 1000) or a percentage such as"
            " 80%"
        )
    value = float(match.group(1))
    if not math.isfinite(value):  # digits past a double's range read as inf
        raise ValueError(f"memory size {text!r} is past any memory")
    if unit == "%":
        if value > 100:
            raise ValueError(f"memory size {text!r}: a percentage is at most 100%")
        return int(value / 100 * (default_total() if total is None else total))
    return int(value * _UNITS[unit])


def host_memory() -> int:
    """This host's memory in bytes (MemTotal), or the cgroup's limit when lower (a container)."""
    total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    if not total:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total


def default_total() -> int:
    """The memory the default limit is a fraction of: the device's on a GPU, else the host's."""
    if backend.device != "cpu":
        return backend.device_memory()["total"]
    return host_memory()


def default_memory_limit() -> int:
    """``DEFAULT_FRACTION`` of ``default_total()``."""
    return int(DEFAULT_FRACTION * default_total())
