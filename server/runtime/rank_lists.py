"""Rank lists in messages and ``Status`` rows, bounded: a slot or a buffer may say it expects up
to 2**32 - 1 contributors, so a list is built from what arrived, never from ``range(expected)``,
and holds at most ``MAX_LISTED`` ranks (the chaos fuzzer's Status took 22 GB before). The hang
doctor (server/collectives/pending.py) and the buffers' wait errors (server/buffers/) both
list ranks this way."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

__all__ = ["MAX_LISTED", "absent", "listed"]

MAX_LISTED = 1024
"""Ranks a rank list of a row or a message holds at most (the lowest ones)."""


def absent(ranks: Iterable[int], present: set[int]) -> list[int]:
    """The first ``MAX_LISTED`` of ``ranks`` (a lazy range) that are not in ``present``: at
    most ``len(present) + MAX_LISTED`` steps, however many ``ranks`` there are."""
    return list(itertools.islice((r for r in ranks if r not in present), MAX_LISTED))


def listed(ranks: list[int]) -> str:
    """``0, 2, 5``; ``none`` for no rank; ``, ...`` after a list cut at ``MAX_LISTED``."""
    more = ", ..." if len(ranks) >= MAX_LISTED else ""
    return ", ".join(map(str, ranks[:MAX_LISTED])) + more if ranks else "none"
