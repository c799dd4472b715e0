"""What a run id may be: one rule for the client that names a run and the servers that hold
its leases.

A collective's key starts with its run: ``<run>:...``, a group's ``<run>/<group>:...``, and
after an epoch restart ``<run>.e<N>...`` (server/collectives/pending.py, ``run_epoch``). A run
id with ``:``, with ``/`` or ending in ``.e<N>`` would read as another run's key, or as one of
its groups or epochs: its leases and aborts would reach the other run's slots.
"""

from __future__ import annotations

import re

__all__ = ["MAX_EPOCH", "MAX_RUN_CHARS", "run_id_problem"]

MAX_RUN_CHARS = 256
MAX_EPOCH = 2**24
"""The highest collective epoch a Lease or Join may name, or a server's notice or Join reply
carry: a run moves on one a recovery, so this is millions of recoveries, far from the 32 bits
a client's next epoch must fit (one past 2**32 - 1 failed every lease request after it)."""
_EPOCH_TAIL = re.compile(r"\.e\d+$")


def run_id_problem(run: str) -> str | None:
    """What is wrong with run id ``run`` (None: nothing)."""
    shown = f"{run[:64]!r}{'...' if len(run) > 64 else ''}"
    if not run or len(run) > MAX_RUN_CHARS:
        return f"a run id has 1..{MAX_RUN_CHARS} characters, got {shown}"
    if ":" in run or "/" in run:
        return f"a run id has no ':' or '/' (a key's and a group's separators), got {shown}"
    if _EPOCH_TAIL.search(run):
        return f"a run id does not end in '.e<digits>' (a restarted epoch's suffix), got {shown}"
    return None
