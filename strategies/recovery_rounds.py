"""A recovery that fails is recovered from in turn: ``recover_until_done``, for both loops of
``train_with_recovery`` (strategies/recovery.py, strategies/elastic_training.py).

A recovery is itself a run of calls to the servers and the other ranks, so the failures it
recovers from can happen during it: a second server lost, a rank killed while the others wait
for it in the recovery's round (the coordinator then aborts the round: "recover again, in a
new epoch"). Each such failure starts another recovery from where the last one stopped, as
the first one started from the step, within the same ``max_recoveries``.

A rank that stops on what no recovery mends (its own code raised, it ran out of recoveries,
Ctrl-C) tells the others through the servers (``stop_the_others``): a final notice, so they
stop at once, naming it and why, unless a launcher may restart it (an elastic rank leaves,
and the members go on without it). Before, they took its silence for a lost server and
recovered, each recovery waiting out its deadline for the rank (120 s each by default: more
than ten minutes with the default ``max_recoveries``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from paramshard.client import ShardClientError, restarts

__all__ = ["recover_until_done", "stop_the_others"]

log = logging.getLogger("paramshard.recovery")


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


def stop_the_others(model: Any, exc: BaseException, step: int) -> None:
    """``exc`` ends ``train_with_recovery`` on this rank at ``step``: the others stop too
    (above). Not when this rank stops on a final notice (another's: it tells its launcher what
    the notice said, client/restarts.py ``declare_stopped``; its own, posted already), nor
    when ``paramshard launch --max-restarts`` may restart it (the others wait for it: its
    lease's ``rejoin_ms``; it tells its launcher why it raised). An
    elastic rank leaves the job instead, and the members redo the step without it (before, a
    rank of a process that lived on, a thread, never left: the step waited its deadline).
    Never raises: ``exc`` is what the caller sees. A ``sys.exit(0)`` is no error: the rank
    ends, as one out of batches does (the launcher tells the servers it ended)."""
    if isinstance(exc, SystemExit) and exc.code in (0, None):
        return
    state = model.client.run_state
    why = restarts.one_line(exc)
    notice = state.current()
    try:
        if getattr(model, "elastic", False):
            model.leave(why)
        elif state.ended_run:  # this rank gave the run up itself: the others know
            restarts.declare_failed(why)
        elif notice is not None and notice.final:  # another's
            restarts.declare_stopped(notice.reason[:400])  # the launcher names who and why
        else:  # its own error: the others stop, unless its launcher may restart it
            state.stop_on_error(
                why, f"stopped at step {step} on an error no recovery mends ({why})"
            )
    except Exception as failed:  # noqa: BLE001 - the servers gone too: nobody to tell
        log.warning("could not tell the other ranks that this one stops: %s", failed)
