"""Run names as clients make them, and the hook through which a wait on other ranks says what
this server knows of the ranks it waited for.

A client's run id is ``<run>``; after ``restart_collectives`` its collectives run under
``<run>.e<epoch>``, and a group's under ``<run>/<group>`` (client/collectives.py,
client/shard_client.py). A group's ranks are its members' indices, not the run's ranks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

__all__ = ["Whereabouts", "grouped", "nothing_known", "run_root"]

Whereabouts = Callable[[str, Sequence[int]], str]
"""``(run, ranks) -> words``: what the server's leases say of ``ranks`` of ``run`` (a rank
that released its lease, one whose lease lapsed), each as ``; ...``, or "" (LeaseTable.whereabouts,
server/collectives/leases.py)."""


def nothing_known(run: str, ranks: Sequence[int]) -> str:
    """The ``Whereabouts`` of a store not wired to the server's leases (tests, tools)."""
    return ""


def run_root(run: str) -> str:
    """The run id ``run`` stands for: without a group's ``/<group>`` or a restart's
    ``.e<epoch>`` suffix."""
    return re.sub(r"\.e\d+$", "", run.split("/", 1)[0])


def grouped(run: str) -> bool:
    """Whether ``run`` is a group's: its ranks are the group's member indices."""
    return "/" in run
