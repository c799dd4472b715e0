"""``paramshard status``'s elastic section: each elastic job's membership and its history.

The job's coordinator (server 0 of its placement, server/collectives/membership.py) reports it
in its Status reply (``StatusReply.memberships``): the newest step decided, its members, how
many ranks joined and left, how many steps had their membership revised mid-step, how many
steps trained at each world size, the ranks waiting to join, and the newest events.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

from paramshard.commands import table

__all__ = ["MEMBERSHIP_COLUMNS", "membership_text"]

MEMBERSHIP_COLUMNS = (
    "JOB", "RUN", "STEP", "GEN", "MEMBERS", "MIN", "JOINS", "LEAVES", "REVISED",
    "STEPS BY WORLD SIZE", "WAITING",
)  # fmt: skip
HISTORY_LINES = 8
"""Events shown per job (the newest; ``--json`` has every one the server keeps)."""


def membership_text(replies: list[dict[str, Any]]) -> str:
    """The elastic jobs the answering servers coordinate, with their newest events; "" when
    there are none."""
    rows, histories = [], []
    for reply in replies:
        for m in reply.get("memberships", []):
            rows.append(_row(m))
            histories.append(_history(m))
    if not rows:
        return ""
    lines = ["Elastic jobs (membership agreed on each job's server 0):"]
    lines += ["  " + line for line in table(MEMBERSHIP_COLUMNS, rows, frozenset()).splitlines()]
    for text in histories:
        lines += text
    return "\n".join(lines)


def _row(m: dict[str, Any]) -> list[str]:
    sizes = sorted(((int(k), int(v)) for k, v in m.get("steps_by_world_size", {}).items()))
    return [
        m["job"],
        m["run"],
        str(m.get("step", 0)),
        str(m.get("generation", 0)),
        ranks_text(m.get("members", [])),
        str(m.get("min_members", 0)),
        str(m.get("joins", 0)),
        str(m.get("leaves", 0)),
        str(m.get("revisions", 0)),
        ", ".join(f"{size}: {steps}" for size, steps in sizes) or "-",
        ranks_text(m.get("waiting", [])),
    ]


def _history(m: dict[str, Any]) -> list[str]:
    events = m.get("history", [])[-HISTORY_LINES:]
    if not events:
        return []
    out = [f"  History of {m['job']} (newest {len(events)}):"]
    for e in events:
        when = datetime.datetime.fromtimestamp(float(e.get("unix", 0.0))).strftime("%H:%M:%S")
        gen = int(e.get("generation", 0))
        again = f" (membership generation {gen})" if gen else ""
        out.append(f"    {when}  step {e.get('step', 0)}: rank {e['rank']} {e['kind']}{again}")
    return out


def ranks_text(ranks: Iterable[int]) -> str:
    """``0-3, 5`` for ranks 0, 1, 2, 3, 5; ``-`` for none."""
    spans: list[list[int]] = []
    for r in sorted(int(r) for r in ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans) or "-"
