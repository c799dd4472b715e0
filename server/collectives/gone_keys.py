"""What the slot store (server/collectives/slots.py) remembers of slot keys that are gone, so
that a late call on one is answered rather than opening a ghost slot: keys read by all their
readers and freed (with their cut, for guessed reads), keys ended (expired, dropped, aborted:
why), and the runs whose epochs were aborted. The store's lock guards it."""

from __future__ import annotations

from collections import OrderedDict

from paramshard.server.collectives.pending import run_epoch

__all__ = ["FORGET_AFTER", "GoneKeys", "of_run"]

FORGET_AFTER = 65536  # freed and ended keys remembered each, the oldest forgotten first


def of_run(key: str, run: str) -> bool:
    """Whether slot ``key`` belongs to run ``run`` (its groups and epochs included)."""
    return key.startswith(run) and run_epoch(key, run) is not None


class GoneKeys:
    """The slot store's memory of keys that are gone (see the module docstring)."""

    def __init__(self) -> None:
        self.freed: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> its cut
        self.ended: OrderedDict[str, str] = OrderedDict()  # expired or dropped: key -> why
        self._aborted: dict[str, tuple[int, str]] = {}  # run -> (last aborted epoch, why)

    def note_freed(self, key: str, cut: tuple[int, int]) -> None:
        self.freed[key] = cut
        while len(self.freed) > FORGET_AFTER:
            self.freed.popitem(last=False)

    def note_ended(self, key: str, why: str) -> None:
        self.ended[key] = why
        while len(self.ended) > FORGET_AFTER:
            self.ended.popitem(last=False)

    def aborted(self, key: str) -> str | None:
        """Why a new slot ``key`` is refused: its run's epoch was aborted (None: it is not)."""
        for run, (epoch, why) in self._aborted.items():
            if (e := run_epoch(key, run)) is not None and e <= epoch:
                return f"slot '{key}': {why}"
        return None

    def abort(self, run: str, epoch: int, why: str) -> None:
        self._aborted[run] = (epoch, why)

    def forget_abort(self, run: str) -> None:
        self._aborted.pop(run, None)

    def forget_run(self, run: str) -> None:
        """Run ``run`` starts again under its id: its keys may all open again."""
        self._aborted.pop(run, None)
        for book in (self.freed, self.ended):
            for key in [k for k in book if of_run(k, run)]:
                del book[key]
