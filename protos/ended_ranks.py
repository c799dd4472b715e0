"""How a server says that a wait cannot complete because the ranks it waits for ended for good
(their processes exited normally and nothing starts them again: uneven inputs), and how a
client tells that apart from a lost server: a FAILED_PRECONDITION whose message holds
``ENDED``. The server words it (server/collectives/lease_words.py ``ended``); the recovery
(strategies/recovery.py) does not take it for a server's loss. Standard library only."""

from __future__ import annotations

__all__ = ["ENDED", "says_ended"]

ENDED = "nothing starts it again, so this wait cannot complete"


def says_ended(code_name: str, details: str) -> bool:
    """Whether a call's status (its code's name and details) says its wait's ranks ended."""
    return code_name == "FAILED_PRECONDITION" and ENDED in details
