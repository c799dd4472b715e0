"""A recovery that fails is recovered from in turn: ``recover_until_done``, for both loops of
``train_with_recovery`` (strategies/recovery.py, strategies/elastic_training.py).

A recovery is itself a run of calls to the servers and the other ranks, so the failures it
recovers from can happen during it: a second server lost, a rank killed while the others wait
for it in the recovery's round (the coordinator then aborts the round: "recover again, in a
new epoch"). Each such failure starts another recovery from where the last one stopped, as
the first one started from the step, within the same ``max_recoveries``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paramshard.client import ShardClientError

__all__ = ["recover_until_done"]


def recover_until_done(
    exc: ShardClientError,
    recoverable: Callable[[ShardClientError], bool],
    recover: Callable[[ShardClientError], None],
    report: Any,
    max_recoveries: int,
) -> None:
    """Runs ``recover(failure)`` from ``exc`` until one completes; a failure it meets starts
    the next. Raises the failure that is not ``recoverable``, or the one met once
    ``report.recoveries`` reached ``max_recoveries`` (each ``recover`` counts itself)."""
    failure = exc
    while True:
        if not recoverable(failure) or report.recoveries >= max_recoveries:
            raise failure
        try:
            recover(failure)
            return
        except ShardClientError as again:
            failure = again
