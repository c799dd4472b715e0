"""Rank-order sums element by element: which contribution each range of a slice adds next.

A step's gradient is summed in rank order (contribution 0, then 1, ...) so every element sees
the same additions whatever the arrival order (server/buffers/contributions.py). Tracking that
order for the whole slice (contribution k waits until contribution k - 1 covered the slice)
keeps every early chunk as a copy until the slowest rank's last chunk of the slice is in: with
a slice spanning a whole model (ZeRO-2) that is up to (W - 1) slices of copies per server.
Tracked per range, a chunk waits only for the chunks before it in rank order *over its own
elements*, so what is staged is bounded by how far ranks drift apart, not by the slice.

``RankOrder`` keeps, for [0, ∞), how many contributions each element has taken, as maximal
runs of equal counts (as many as the chunk boundaries at most, usually one or two).

An early chunk first waits for its turn, holding its request, and is added from it without a
copy; only past the bounds of server/runtime/turns.py is it staged as a copy.
"""

from __future__ import annotations

import bisect

__all__ = ["RankOrder"]


class RankOrder:
    """Contributions taken per element: run i is [starts[i], starts[i + 1]) (the last run is
    open-ended) and has taken ``taken[i]``."""

    __slots__ = ("starts", "taken")

    def __init__(self) -> None:
        self.starts: list[int] = [0]
        self.taken: list[int] = [0]

    def _run(self, offset: int) -> int:
        return bisect.bisect_right(self.starts, offset) - 1

    def ready(self, offset: int, numel: int, k: int) -> bool:
        """Whether every element of [offset, offset + numel) has taken contributions 0..k-1
        and not k: contribution k's chunk there may be added now."""
        i = self._run(offset)
        if self.taken[i] != k:
            return False
        return i + 1 == len(self.starts) or self.starts[i + 1] >= offset + numel

    def runs(self, offset: int, numel: int) -> list[tuple[int, int, int]]:
        """[offset, offset + numel) cut where its count changes: (start, stop, taken) each."""
        out, i, end = [], self._run(offset), offset + numel
        while offset < end:
            stop = min(end, self.starts[i + 1]) if i + 1 < len(self.starts) else end
            out.append((offset, stop, self.taken[i]))
            offset, i = stop, i + 1
        return out

    def advance(self, offset: int, numel: int) -> None:
        """[offset, offset + numel), ``ready`` for its contribution, took it."""
        if numel <= 0:
            return
        i, end = self._run(offset), offset + numel
        k = self.taken[i]
        nxt = self.starts[i + 1] if i + 1 < len(self.starts) else None
        if nxt is not None and nxt < end:
            raise ValueError(f"[{offset:,}, {end:,}) is not one run: it cannot take one more")
        # split run i into [start, offset) k, [offset, end) k + 1, [end, next) k
        if nxt is None or end < nxt:
            self.starts.insert(i + 1, end)
            self.taken.insert(i + 1, k)
        if self.starts[i] < offset:
            self.starts.insert(i + 1, offset)
            self.taken.insert(i + 1, k + 1)
            i += 1
        else:
            self.taken[i] = k + 1
        # merge with equal neighbours: runs stay maximal, so a ready range lies in one run
        if i + 1 < len(self.starts) and self.taken[i + 1] == k + 1:
            del self.starts[i + 1], self.taken[i + 1]
        if i > 0 and self.taken[i - 1] == k + 1:
            del self.starts[i], self.taken[i]
