"""How a session's sender makes a batch (client/session.py, server/sessions.py): whatever is
ready when the stream takes its next message goes in it, so calls made together travel
together, and one call alone is never held back waiting for company."""

from __future__ import annotations

import queue
from typing import Any

__all__ = ["take_ready"]


def take_ready(items: queue.SimpleQueue[Any], end: Any) -> tuple[list[Any], bool]:
    """Waits for one item of ``items``, then takes every other one already there. Returns
    them and whether ``end`` came (it stays queued for the next call, which returns at once)."""
    first = items.get()
    if first is end:
        items.put(end)
        return [], True
    batch = [first]
    while True:
        try:
            more = items.get_nowait()
        except queue.Empty:
            return batch, False
        if more is end:
            items.put(end)
            return batch, True
        batch.append(more)
