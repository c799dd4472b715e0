"""What the slot store (server/collectives/slots.py) remembers of slot keys that are gone, so
that a late call on one is answered rather than opening a ghost slot: keys read by all their
readers and freed (with their cut, for guessed reads), keys ended (expired, dropped, aborted:
why), and the runs whose epochs were aborted. The store's lock guards it.

A run that starts again under its id forgets its keys (``forget_run``). Keys are found by their
run through an index of their heads (the part before ``:``, e.g. ``r``, ``r.e1/tp``), sorted,
so forgetting costs a bisection and the run's own keys, not a walk over the 65,536 a book
keeps: a caller who starts runs one after another cannot hold the store's lock for long."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter, OrderedDict
from typing import Generic, TypeVar

from paramshard.protos.run_ids import MAX_RUN_CHARS
from paramshard.server.collectives.pending import run_epoch

__all__ = ["ENTRY_BYTES", "FORGET_AFTER", "FORGET_BYTES", "GoneKeys", "of_run"]

FORGET_AFTER = 65536  # freed and ended keys remembered each, the oldest forgotten first
FORGET_BYTES = 48 * 2**20
"""What each book may hold, the oldest forgotten first, counted by ``_cost``. Keys of a few
dozen characters stay within ``FORGET_AFTER`` (at most 46 MB); before, a caller's keys of
1,024 characters held 500 MiB here, outside the memory account, by the count alone."""
ENTRY_BYTES = 512
"""An entry's own objects beside its characters: measured with tracemalloc (CPython 3.11),
20,000 entries each took at most 570 bytes with keys of 17 characters and their reasons,
2,562 with keys of 904 characters of distinct heads; ``_cost`` gives 621 and 3,295."""
V = TypeVar("V")


def _cost(key: str, value: object) -> int:
    """An upper bound of what an entry holds: the key, its head's copy, its reason."""
    return ENTRY_BYTES + 2 * len(key) + (len(value) if isinstance(value, str) else 0)


def of_run(key: str, run: str) -> bool:
    """Whether slot ``key`` belongs to run ``run`` (its groups and epochs included)."""
    return key.startswith(run) and run_epoch(key, run) is not None


class _Book(Generic[V]):
    """Keys remembered with the caller (token) whose slot they were; past ``FORGET_AFTER``
    keys or ``FORGET_BYTES``, the oldest key of the caller holding the most bytes is
    forgotten first, so one team's many keys push out its own, never another's while that
    one holds less (a review: 20,400 of team A's keys pushed team B's freed message out, and
    B's retry of it opened a ghost slot). Found by their run too."""

    def __init__(self) -> None:
        self.items: OrderedDict[str, V] = OrderedDict()
        self.bytes = 0  # ``_cost`` of the items
        self._owner: dict[str, str | None] = {}  # key -> the caller whose slot it was
        self._by_owner: dict[str | None, OrderedDict[str, None]] = {}  # oldest first
        self._owner_bytes: Counter[str | None] = Counter()
        self._heads: dict[str, set[str]] = {}  # head -> its keys here
        self._sorted: list[str] = []  # the heads, sorted: a run's are side by side

    def put(self, key: str, value: V, owner: str | None = None) -> None:
        if key in self.items:
            self._remove(key)
        self.items[key] = value
        cost = _cost(key, value)
        self.bytes += cost
        self._owner[key] = owner
        self._by_owner.setdefault(owner, OrderedDict())[key] = None
        self._owner_bytes[owner] += cost
        head = key.split(":", 1)[0]
        if head not in self._heads:
            self._heads[head] = set()
            insort(self._sorted, head)
        self._heads[head].add(key)
        while len(self.items) > FORGET_AFTER or self.bytes > FORGET_BYTES:
            most = max(self._owner_bytes, key=self._owner_bytes.__getitem__)
            self._remove(next(iter(self._by_owner[most])))

    def forget_run(self, run: str) -> None:
        heads = []
        for head in self._sorted[bisect_left(self._sorted, run) :]:
            if not head.startswith(run):
                break
            if of_run(head + ":", run):
                heads.append(head)
        for head in heads:
            for key in list(self._heads[head]):
                self._remove(key)

    def _remove(self, key: str) -> None:
        cost = _cost(key, self.items.pop(key))
        self.bytes -= cost
        owner = self._owner.pop(key)
        keys = self._by_owner[owner]
        del keys[key]
        self._owner_bytes[owner] -= cost
        if not keys:
            del self._by_owner[owner], self._owner_bytes[owner]
        head = key.split(":", 1)[0]
        keys_of_head = self._heads[head]
        keys_of_head.discard(key)
        if not keys_of_head:
            del self._heads[head]
            del self._sorted[bisect_left(self._sorted, head)]


class GoneKeys:
    """The slot store's memory of keys that are gone (see the module docstring)."""

    def __init__(self) -> None:
        self._freed: _Book[tuple[int, int]] = _Book()  # key -> its cut
        self._ended: _Book[str] = _Book()  # expired or dropped: key -> why
        self._aborted: dict[str, tuple[int, str]] = {}  # run -> (last aborted epoch, why)

    @property
    def freed(self) -> OrderedDict[str, tuple[int, int]]:
        return self._freed.items

    @property
    def ended(self) -> OrderedDict[str, str]:
        return self._ended.items

    def note_freed(self, key: str, cut: tuple[int, int], owner: str | None = None) -> None:
        self._freed.put(key, cut, owner)

    def note_ended(self, key: str, why: str, owner: str | None = None) -> None:
        self._ended.put(key, why, owner)

    def aborted(self, key: str) -> str | None:
        """Why a new slot ``key`` is refused: its run's epoch was aborted (None: it is not).
        Only the runs ``key`` can belong to are looked up: its head up to each ``.`` or ``/``
        and whole, as long as a run id can be. Before, every aborted run was tried, under the
        store's lock, for every new key of every team (a review: a 2 ms all-reduce took
        1.4-1.6x as long beside 4,048 runs another team had aborted)."""
        head = key.split(":", 1)[0]
        ends = [i for i, c in enumerate(head[: MAX_RUN_CHARS + 1]) if c in "./"]
        if len(head) <= MAX_RUN_CHARS:
            ends.append(len(head))
        for end in ends:
            run = head[:end]
            found = self._aborted.get(run)
            if found is not None and (e := run_epoch(key, run)) is not None and e <= found[0]:
                return f"slot '{key}': {found[1]}"
        return None

    def abort(self, run: str, epoch: int, why: str) -> None:
        self._aborted[run] = (epoch, why)

    def forget_abort(self, run: str) -> None:
        self._aborted.pop(run, None)

    def forget_run(self, run: str) -> None:
        """Run ``run`` starts again under its id: its keys may all open again."""
        self._aborted.pop(run, None)
        self._freed.forget_run(run)
        self._ended.forget_run(run)
