"""Training that survives a shard server dying: checkpoint every k steps, restore and replay.

``train_with_recovery`` runs ``train_step(step)`` for each step. Every ``checkpoint_every``
steps it snapshots the job on the servers (``save_checkpoint``). When a call fails because a
server died (UNAVAILABLE after the client's retries, a restarted server that lost the job:
NOT_FOUND, a wait that can no longer finish: DEADLINE_EXCEEDED, or the abort notice of another
rank that is recovering: ABORTED, client/leases.py), every rank:

1. tells the others through the servers (an abort notice for its epoch: a rank waiting for
   this one's contribution stops at once instead of at its deadline), and drops the half-done
   step (pending pushes, gradients, gathered units);
2. waits, bounded, until every server answers again;
3. restarts collective numbering in a new epoch (ranks may have failed at different calls);
4. brings every server back to one version (rank 0): from neighbour replicas when the job
   replicates (``replicate_every``; at most that many steps back), else from the newest
   complete snapshot (``JobLost`` when neither holds the job: not recovered from); every
   rank adopts that step;
5. replays from there.

A 3D job (``HybridShardedModel``) recovers the same way, every group's collectives restarted,
all its parts restored from their newest common snapshot (it has no neighbour replicas).

Progress: ``progress=`` takes a ``tqdm`` bar (or anything with ``update(n)``; its counter
follows ``model.step_count``, so a replay moves it back, and ``set_postfix`` shows the loss) or a
function ``progress(step, loss)`` called after each step with the step passed to ``train_step``.
``should_stop(step, loss)`` returning True ends training after that step (early stopping: every
rank must return the same, e.g. from an all-reduced validation loss). Both run inside the
recovery: a server dying during them is recovered like one dying in ``train_step``. So does
``finish()``, the ranks' work with the servers once training has ended (a final evaluation,
gathering the model for a sample or an export): a server dying before every rank is through
it is recovered, and every rank runs it again.

``train_step`` must be a function of the step number (the same data for the same step), so
the replayed steps are the ones that were lost and training ends where it would have without
the failure. At most ``checkpoint_every`` steps are recomputed.

``scheduler``: a torch LR scheduler kept at the servers' step (``sync_scheduler``): stepped
after each step (unless ``train_step`` stepped it), set back when a recovery goes back.

A *trainer* that dies is another matter: ``paramshard launch --max-restarts`` restarts it and
its model adopts the servers' step (paramshard/restarts.py). The snapshots and recoveries here
synchronise the ranks with collectives numbered in order, and the others made some the new
process did not (a server forgets a collective once every rank has read it): so in a fixed
world, the restarted rank (``model.restarted_alone``) starts with a recovery of every rank, in
a new epoch whose collectives start afresh ("rank 1 recovers: it was restarted at step N"),
in which nothing is restored when every server holds the job at one version. When its server
was lost with it (a node down), the others are recovering that server, and the restarted rank
joins that recovery as it attaches instead (strategies/data_parallel/checkpoints.py,
``_join_recovery``). An *elastic* job
(``ShardingConfiguration(elastic=True)``) synchronises each step's members instead, so a rank
may die, come back or join while this runs, and a server may be lost in the same run
(strategies/elastic_training.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from paramshard.client import ShardClientError, replicas
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.ended_ranks import says_ended
from paramshard.strategies.checkpoint_tags import CheckpointTags
from paramshard.strategies.data_parallel.sharded import ServerShardedModel
from paramshard.strategies.elastic_training import train_elastic
from paramshard.strategies.lr_schedule import sync_scheduler
from paramshard.strategies.recovery_report import RESTARTED, RecoveryReport
from paramshard.strategies.recovery_rounds import recover_until_done, stop_the_others

if TYPE_CHECKING:
    from paramshard.strategies.hybrid import HybridShardedModel

__all__ = ["train_with_recovery", "RecoveryReport"]

log = logging.getLogger("paramshard.recovery")

RECOVERABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,  # a push for a step the restarted server is not at
    grpc.StatusCode.CANCELLED,
}
_MEETS = "every rank meets it in a new epoch"  # a restarted rank's notice ends with it


class ProgressBar(Protocol):
    """What ``progress=`` needs of a bar: tqdm's ``n``, ``update`` and ``set_postfix``."""

    n: Any

    def update(self, n: int = 1) -> Any: ...


def _show(
    progress: Callable[[int, float], Any] | ProgressBar, step: int, loss: float, done: int
) -> None:
    """Reports one finished step to a ``progress(step, loss)`` function or a tqdm-like bar."""
    if callable(progress):
        progress(step, loss)
        return
    set_postfix = getattr(progress, "set_postfix", None)
    if set_postfix is not None:
        set_postfix(loss=f"{loss:.4f}", refresh=False)
    progress.update(done - int(progress.n))  # negative after a replay: the bar moves back


def _recoverable(model: ServerShardedModel | HybridShardedModel, exc: ShardClientError) -> bool:
    """A server failure (``RECOVERABLE``), or an abort notice saying another rank is
    recovering from one; not a notice that a rank was lost (its process and state are gone),
    nor a wait for ranks that ended (uneven inputs: no server was lost, nothing would meet)."""
    if says_ended(exc.code.name, exc.details):
        return False
    if exc.code != grpc.StatusCode.ABORTED:
        return exc.code in RECOVERABLE
    if getattr(model, "elastic", False):  # a member lost or gone: the others redo the step
        notice = model.client.run_state.current()  # without it, unless the job is lost
        return notice is None or not notice.final
    notice = model.client.run_state.refresh()
    return notice is not None and notice.recoverable


def _wait_for_servers(model: ServerShardedModel | HybridShardedModel, wait_s: float) -> None:
    client = model.client
    deadline = time.monotonic() + wait_s
    for i in range(client.num_servers):
        while True:
            try:
                client.call(i, "Status", pb.StatusRequest())
                break
            except ShardClientError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"server {i} ({client.spec.addresses[i]}) did not come back within"
                        f" {wait_s:.0f} s: {exc.details}"
                    ) from exc
                time.sleep(0.2)


def _recover(
    model: ServerShardedModel | HybridShardedModel,
    exc: ShardClientError | None,
    step: int,
    epoch: int,
    wait_s: float,
    report: RecoveryReport,
    restarted: bool = False,
) -> None:
    """After ``step`` failed with ``exc`` (None: this process comes restarted alone, before
    its first step): tells the other ranks, drops the step, waits for the servers, numbers
    the collectives afresh in ``epoch`` and brings the model back to the servers' step
    (``model.recover()``); ``report`` records it. ``restarted``: this process came restarted
    and has not met the others yet (a failure may cut its first meeting short): it says so at
    this one, else rank 0 restores the job as after a server's loss (back to a snapshot, or
    JobLost without one)."""
    began = time.monotonic()
    source = model.recovery_source
    if exc is None:
        log.warning(
            "rank %d: restarted at step %d, behind the other ranks' collectives: %s (a restore"
            " only if a step was half applied)",
            model.rank, step, _MEETS,
        )  # fmt: skip
        model.client.run_state.give_up(f"recovers: it was restarted at step {step}; {_MEETS}")
    elif exc.code == grpc.StatusCode.ABORTED:  # another rank's notice (logged as it came)
        notice = model.client.run_state.notice
        if notice is not None and notice.reason.endswith(_MEETS):  # no server was lost
            source = "meeting a restarted rank (a restore only if a step was half applied)"
        log.warning("rank %d: step %d: recovering with the others, %s", model.rank, step, source)
        model.client.run_state.give_up(f"recovers with the others from step {step}")
    else:
        lost = f"server {exc.server} ({exc.address}) lost at step {step}"
        log.warning(
            "rank %d: %s: %s (%s: %s: %s)",
            model.rank,
            lost,
            source,
            exc.method,
            exc.code.name,
            exc.details,
        )
        # the ranks waiting on this one learn now, through the servers, not at a deadline
        model.client.run_state.give_up(f"recovers: {lost} ({exc.method}: {exc.code.name})")
    report.recoveries += 1
    report.causes.append(RESTARTED if exc is None else exc.code.name)
    model.abandon_step()
    if model.optimizer is not None:
        model.optimizer.zero_grad()
    _wait_for_servers(model, wait_s)
    model.restart_collectives(epoch)
    # Ranks notice the failure at different times: one waiting for a failed rank's tensor
    # finds out only at its call's deadline. The others wait for it at the recovery's first
    # barrier, so that wait may last up to ``wait_s``.
    client = model.client
    deadline, client.timeout_s = client.timeout_s, max(client.timeout_s, wait_s)
    try:
        restored = model.recover(restarted=True) if exc is None or restarted else model.recover()
    finally:
        client.timeout_s = deadline
    report.recovered(step, restored, began)
    log.warning(
        "rank %d: recovered in %.1f s: the servers are at step %d, training continues there"
        " (%d steps replayed)",
        model.rank,
        report.recovery_seconds[-1],
        restored,
        max(0, step - restored),
    )


def _decide_again(
    should_stop: Callable[[int, float], bool] | None,
    held: int,
    steps: int,
    report: RecoveryReport,
) -> int:
    """The step count training ends at after a recovery that left the servers at step
    ``held``: ``should_stop`` decides again on the last step they hold, whose call may have been
    cut short by the failure (a validation's all-reduce) or never made (the rank failed after
    the update, or is a restarted process: its loss is NaN then). Every rank recovers to the
    same ``held``, so every rank asks alike; a step replayed later is asked as it is trained."""
    report.stopped_early = False
    if should_stop is None or not 0 < held <= steps:
        return steps
    if should_stop(held - 1, report.losses.get(held - 1, math.nan)):
        report.stopped_early = True
        return held
    return steps


def train_with_recovery(
    model: ServerShardedModel | HybridShardedModel,
    train_step: Callable[[int], float],
    steps: int,
    *,
    checkpoint_every: int = 10,  # 0: no snapshots (neighbour replicas only)
    tag_prefix: str = "auto",
    keep_last: int = 10,  # 0: keep every checkpoint
    wait_s: float = 120.0,
    max_recoveries: int = 5,
    progress: Callable[[int, float], Any] | ProgressBar | None = None,
    should_stop: Callable[[int, float], bool] | None = None,
    scheduler: Any = None,
    finish: Callable[[], Any] | None = None,
) -> RecoveryReport:
    """Runs ``train_step(step)`` for steps ``model.step_count .. steps-1`` surviving server
    failures (see the module docstring). ``train_step`` does forward, backward and the
    optimizer step and returns the loss. Every rank calls this the same way.

    ``progress``: a tqdm bar or a ``progress(step, loss)`` function, told after each step;
    ``should_stop(step, loss)``: True (on every rank) ends training after that step; after a
    recovery (fixed world or elastic) it is asked again for the last step the servers hold (a
    validation the failure cut short is redone; the loss is NaN where this rank has none for
    that step);
    ``scheduler``: an LR scheduler kept at ``model.step_count``;
    ``keep_last``: after each checkpoint, the job's checkpoints of ``tag_prefix`` taken
    before the last ``keep_last`` are deleted from the servers' snapshot folders (0 keeps them
    all; tags saved by hand are never deleted: strategies/checkpoint_tags.py);
    ``finish()``: what every rank does with the servers once training has ended (a final
    evaluation, gathering the model, an export), followed by a barrier: a server dying before
    every rank is through it is recovered like one dying in a step (steps the recovery went
    back are replayed), and ``finish`` runs again. Not for an elastic job, whose ranks need
    not end together."""
    if keep_last < 0:
        raise ValueError(
            f"train_with_recovery: keep_last must be 0 (keep all) or more, not {keep_last}"
        )
    if not hasattr(model, "recover"):  # DDP: parameters and optimizer state in the trainer
        raise TypeError(
            f"train_with_recovery needs a model whose state the servers hold (ZeRO-1/2, FSDP or"
            f" a 3D HybridShardedModel), not a {type(model).__name__}: a DDP model keeps its"
            " parameters and optimizer state in each trainer, which a server's loss does not"
            " touch and a recovery could not restore; train it in a loop of your own"
        )
    if not model.registered:
        raise RuntimeError("train_with_recovery needs an optimizer wrapper attached first")
    if finish is not None and getattr(model, "elastic", False):
        raise ValueError(
            "train_with_recovery: finish= is not supported for an elastic job (its ranks may"
            " leave or join at the end, so no barrier holds them all); do the final work after"
            " train_with_recovery returns"
        )
    report = RecoveryReport()
    # a restarted rank that joined the others' recovery as it attached starts in their epoch
    epoch = model.client.run_state.epoch
    replicated = model.rank == 0 and getattr(model.config, "replicate_every", 0)

    def after_step(step: int, loss: float) -> bool:
        if progress is not None:
            _show(progress, step, loss, model.step_count)
        if replicated and (step + 1) % replicas.CHECK_STEPS == 0:
            replicas.say_failures(model.client, model.config.job)
        return should_stop is not None and should_stop(step, loss)

    tags = CheckpointTags(model, tag_prefix, bool(checkpoint_every), keep_last)

    def checkpoint() -> None:
        tags.take(model, model.step_count, epoch)

    # a server that stops answering lease renewals ends the epoch at once: recovery is
    # cheaper than waiting out retries (client/leases.py)
    state = model.client.run_state
    fail_fast, state.fail_fast = state.fail_fast, True

    meeting = False  # this process came restarted and has not met the others yet

    def recover(failure: ShardClientError | None, at: int) -> None:
        nonlocal epoch, meeting
        epoch += 1
        meeting = meeting or failure is None
        _recover(model, failure, at, epoch, wait_s, report, restarted=meeting)
        meeting = False

    step = model.step_count  # the step run last: a failure names it
    try:
        if getattr(model, "elastic", False):
            hooks = SimpleNamespace(
                recoverable=_recoverable,
                wait_for_servers=lambda m: _wait_for_servers(m, wait_s),
                after_step=after_step,
                decide_again=lambda held: _decide_again(should_stop, held, steps, report),
            )
            train_elastic(
                model, train_step, steps, hooks, report, checkpoint_every=checkpoint_every,
                tags=tags, max_recoveries=max_recoveries, scheduler=scheduler,
            )  # fmt: skip
            return report
        sync_scheduler(scheduler, model.step_count)
        # a rank restarted alone meets the others first; a snapshot as training starts, not
        # after a recovery (the others go on from it without one)
        behind = getattr(model, "restarted_alone", False)
        # else no step, nothing at the end: the others, if any, are through with the servers
        behind = behind and (
            model.step_count < steps or finish is not None or should_stop is not None
        )
        starts = bool(checkpoint_every) and model.step_count % checkpoint_every == 0
        snapshot = starts and not epoch and not behind
        end = steps  # the step count training ends at: ``steps``, or after should_stop said so
        decide = False  # after a recovery: should_stop decides again on the step held
        while True:
            step = model.step_count
            try:
                if behind:
                    behind = False
                    recover(None, step)
                    decide = True
                    sync_scheduler(scheduler, model.step_count)
                    continue
                if decide:
                    decide = False
                    end = _decide_again(should_stop, step, steps, report)
                if snapshot:
                    snapshot = False
                    checkpoint()
                if step < end:
                    report.losses[step] = loss = train_step(step)
                    sync_scheduler(scheduler, model.step_count)
                    if checkpoint_every and model.step_count % checkpoint_every == 0:
                        checkpoint()
                    if after_step(step, loss):
                        report.stopped_early, end = True, step + 1
                    continue
                if finish is not None:
                    finish()
                    model.config.client.barrier()  # every rank is through it, or all recover
                model.confirm_kept()  # no server restarted empty since the last update
                break
            except ShardClientError as exc:
                snapshot = False  # the others go on without it
                recover_until_done(
                    exc,
                    lambda f: _recoverable(model, f),
                    lambda f, at=step: recover(f, at),
                    report,
                    max_recoveries,
                )
                decide = True
                sync_scheduler(scheduler, model.step_count)
    except BaseException as exc:
        stop_the_others(model, exc, step)
        raise
    finally:
        state.fail_fast = fail_fast
    return report
