"""``train_with_recovery`` for an elastic job: each step joined, trained by its members, redone
when its members change (strategies/data_parallel/elastic.py says what elastic means).

The loop differs from the fixed-world one (strategies/recovery.py) in three ways:

1. each step begins with ``model.join_step()``: the rank waits until it is a member of the
   step the servers train next (a rank that joins, or sat a step out, adopts a later step), and
   ``train_step`` is then called with that step's number, so its batch is that step's;
2. a snapshot (``checkpoint_every``) is taken *before* a step whose number is a multiple of
   it, by the step's members (strategies/data_parallel/elastic_checkpoints.py);
3. an abort notice is always recoverable: a member was lost or left (the others redo the step
   without it: its membership is revised on the coordinator, server/collectives/membership.py
   step 5) or a server failed (the servers are brought back to one version first: ``resync``).
   A rank that met the failure itself tells the others (``give_up``), unless it only learned
   that the step's membership changed (a push of an older generation refused).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from paramshard.client import ShardClientError
from paramshard.strategies.lr_schedule import sync_scheduler
from paramshard.strategies.recovery_rounds import recover_until_done

__all__ = ["recover_elastic", "train_elastic"]

log = logging.getLogger("paramshard.recovery")

STALE_GENERATION = "membership generation"
"""What a server's refusal of an older generation's push says (server/buffers/membership.py)."""
GONE_ON = "is already applied"
"""What a server's refusal of a step's norm says once the step went on without this rank (it
pushed its gradient, then was late past the join window: server/buffers/steps.py)."""


def recover_elastic(model: Any, exc: ShardClientError, step: int, hooks: Any, report: Any) -> None:
    """After ``step`` failed with ``exc``: drops the step, moves to a new epoch and brings the
    servers and this rank to one step (``hooks``: ``wait_for_servers(model)``)."""
    began = time.monotonic()
    state = model.client.run_state
    log.warning("rank %d: step %d failed (%s); recovering", model.rank, step, exc)
    # the step's membership changed without this rank: nothing the others train is wrong, so
    # it does not abort their epoch (it did: each member recovered, for every late wake-up)
    stale = exc.code == grpc.StatusCode.FAILED_PRECONDITION and (
        STALE_GENERATION in exc.details or GONE_ON in exc.details
    )
    if exc.code != grpc.StatusCode.ABORTED and not stale:
        state.give_up(f"recovers from step {step}: {exc.method} {exc.code.name}")
    notice = state.current()
    report.recoveries += 1
    report.causes.append(exc.code.name)
    model.abandon_step()
    if model.optimizer is not None:
        model.optimizer.zero_grad()
    hooks.wait_for_servers(model)
    epoch = state.next_epoch(notice)
    model.restart_collectives(epoch)
    restored = model.resync(epoch, model.config.join_window_s)
    report.recovered(step, restored, began)
    log.warning(
        "rank %d: recovered in %.1f s: the servers are at step %d, training continues there",
        model.rank,
        report.recovery_seconds[-1],
        restored,
    )


def _check_epoch(model: Any) -> None:
    """Moves this rank past a notice that aborted its epoch as its training ended (one that
    came during its last recovery, after the recovery had read the notices, left it in an
    aborted epoch with its steps done: its next call, ``state_dict()``, failed with ABORTED).
    Its servers hold the job whole at its last step (``confirm_kept`` said so before), so
    nothing is left to recover: it numbers its collectives in the next epoch."""
    state = model.client.run_state
    notice = state.current()
    if notice is not None and not notice.final:  # a final one fails the rank's next wait
        log.warning(
            "rank %d: training ended in an aborted epoch (%s); the servers hold every step:"
            " moving on to the next epoch",
            model.rank,
            notice.reason,
        )
        model.restart_collectives(state.next_epoch(notice))


def train_elastic(
    model: Any,
    train_step: Callable[[int], float],
    steps: int,
    hooks: Any,
    report: Any,
    *,
    checkpoint_every: int,
    tags: Any,
    max_recoveries: int,
    scheduler: Any,
) -> None:
    """The elastic loop (module docstring); ``hooks``: ``recoverable(model, exc)``,
    ``wait_for_servers(model)``, ``after_step(step, loss) -> stop`` and, after a recovery
    that left the servers at step ``held``, ``decide_again(held) -> the step count training
    ends at`` (``should_stop`` asked again about the last step they hold, as in the fixed world:
    its call may have been cut short by the failure)."""
    taken = -1  # the step a checkpoint was taken before, in this epoch
    end = steps  # the step count training ends at: ``steps``, or after should_stop said so
    while True:
        step = model.step_count
        try:
            if step < end:
                model.join_step(until=end)  # a rank that comes as the job ends joins nothing
                step = model.step_count
            if step >= end:
                model.confirm_kept()  # no server restarted empty since the last update
                _check_epoch(model)
                break
            sync_scheduler(scheduler, step)
            if checkpoint_every and step % checkpoint_every == 0 and step != taken:
                tags.take(model, step, model.client.run_state.epoch)
                taken = step
            if model.membership is not None:  # it trains the step now: should it leave (an
                model.membership.training = step  # exception), the others redo the step without it
            report.losses[step] = loss = train_step(step)
            sync_scheduler(scheduler, model.step_count)
            if hooks.after_step(step, loss):
                report.stopped_early, end = True, model.step_count
        except ShardClientError as exc:
            recover_until_done(
                exc,
                lambda failure: hooks.recoverable(model, failure),
                lambda failure, at=step: recover_elastic(model, failure, at, hooks, report),
                report,
                max_recoveries,
            )
            taken = -1
            sync_scheduler(scheduler, model.step_count)
            end = hooks.decide_again(model.step_count)
