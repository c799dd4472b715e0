"""A server-sharded model's checkpoints and recovery: snapshots on the servers, restores
(resharded when the number of servers changed), recovery from neighbour replicas or the newest
snapshot, and dropping a step a failure cut short."""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc
import numpy as np

from paramshard.client import ShardClientError, restarts
from paramshard.client.carry import restore_or_carry
from paramshard.client.run_state import Notice
from paramshard.client.snapshot_layouts import PLAIN
from paramshard.strategies.data_parallel.elastic import REBUILD_POLL_S
from paramshard.strategies.data_parallel.elastic_checkpoints import ElasticCheckpoints, job_versions

__all__ = ["ServerCheckpoints"]

log = logging.getLogger("paramshard.recovery")


class ServerCheckpoints(ElasticCheckpoints):
    """Mixed into ``ServerShardedModel``: every rank calls these at the same point (an
    elastic job: every member of the step, strategies/data_parallel/elastic_checkpoints.py)."""

    prepare_carried: Any  # strategies/data_parallel/server_optim.py

    restarted_alone = False
    """This process is a rank of a fixed-world job restarted alone (``paramshard launch
    --max-restarts``; its servers kept the job): the others numbered collectives it did not
    make, so it meets them in a new epoch before its first one (``train_with_recovery`` does,
    ``recover(restarted=True)``). False once it has, and for a rank that joined the others'
    recovery of a server lost with it (``_join_recovery``)."""
    _joined = False  # this rank joined the others' recovery as it attached

    def save_checkpoint(self, tag: str) -> int:
        """Snapshot of this job on the servers (params, optimizer state, step) under ``tag``,
        in each server's --snapshot-dir. Every rank calls it at the same point; returns the
        version captured. Elastic: the members of the step about to be trained call it."""
        from paramshard.client import tools

        if self.membership is not None:
            return self._elastic_save(tag)
        self.ensure_idle()
        version = self._step
        if self.rank == 0:
            version = tools.snapshot(self.client, self.config.job, tag)["version"]
        self.client.barrier()
        return version

    def load_checkpoint(self, tag: str = "latest") -> int:
        """Restores snapshot ``tag`` into the servers (resharded if their number changed) and
        continues from its step. A snapshot of a 3D job (``HybridShardedModel``) under this
        job's name is carried to this model, parameters and optimizer state
        (client/carry.py). Every rank calls it at the same point; returns that step."""
        from paramshard.client import tools

        if not self.registered:
            raise RuntimeError("load_checkpoint needs an optimizer wrapper attached first")
        if self.membership is not None:
            return self._elastic_load(tag)
        self.ensure_idle()
        self.client.barrier()  # nobody still reads the old state when rank 0 replaces it
        restore_or_carry(
            self.client,
            self.config.job,
            tag,
            self.world_size,
            PLAIN,
            self.prepare_carried,
        )
        if self.rank == 0:
            if self.config.replicate_every:
                tools.configure_replication(
                    self.client, self.config.job, self.config.replicate_every
                )
        self.client.barrier()
        self._loaded = None if tag == "latest" else (tag, time.time())
        return self.adopt_server_version()

    @property
    def recovery_source(self) -> str:
        """What ``recover`` restores from, in words (for the recovery's messages)."""
        if self.config.replicate_every:
            return "restoring from its neighbour's replica"
        return "restoring from the newest snapshot"

    def recover(self, restarted: bool = False) -> int:
        """After a server died and came back: every server returns to the newest version they
        can all reach, from neighbour replicas when configured, else from the newest snapshot.
        Every rank calls it at the same point; returns the step to continue from.

        ``restarted``: this rank comes restarted alone (``restarted_alone``), which every
        rank learns at the recovery's first meeting. Its servers lost nothing: when every one
        holds the job at one version, nothing is restored (a restore could only go back, or
        find nothing to restore before the first snapshot), and the others' half-done step is
        replayed; servers at several versions (a step half applied) are restored."""
        if self.membership is not None:  # the facts decide, a recovery round if they must
            return self.resync(self.client.run_state.epoch, self.config.join_window_s)
        self.ensure_idle()
        # every rank has dropped its half-done step; the max: whether one comes restarted
        came = self.client.all_reduce(np.array([int(restarted)], dtype=np.int64), "max")
        if self.rank == 0:
            if not came[0] or not self._kept_whole():
                self._recover_job()
        self.client.barrier()
        self.restarted_alone = False
        return self.adopt_server_version()

    def lost_servers(self) -> list[int]:
        """The job's servers (indices of this rank's client) that hold none of its values, or
        hold them at another step than this rank's: a server restarted empty after the last
        update (``confirm_kept``)."""
        versions = job_versions(self.client, self.config.job)
        return [i for i, v in enumerate(versions) if v != self.step_count]

    def confirm_kept(self) -> None:
        """``confirm_kept`` (below) for this job, as ``train_with_recovery`` ends."""
        confirm_kept(self.client, self.config.job, self.step_count, self.lost_servers())

    def _kept_whole(self) -> bool:
        """Whether every server holds every slice of the job, all at one version (registering
        again leaves a buffer there as it is)."""
        held, empty = self._register(self._flat_buffers)
        if empty or len(held) != 1:
            return False
        log.warning(
            "job '%s': every server holds it at step %d: nothing to restore",
            self.config.job, next(iter(held)),
        )  # fmt: skip
        return True

    def _rebuilt(
        self, buffers: list[Any], held: set[int], empty: set[int]
    ) -> tuple[set[int], set[int]]:
        """A server restarted empty after the job's first step, found by a rank that comes
        to a running job (restarted, or elastic): the others rebuild it. Elastic, this rank
        waits for them (``_await_rebuilt``); in a fixed world it joins their recovery
        (``_join_recovery``). Returns the versions of the slices that hold values and of those
        that hold none, as ``_register`` does."""
        if self.elastic:
            return self._await_rebuilt(lambda: self._register(buffers), held, empty)
        self._flat_buffers = buffers
        return {self._join_recovery()}, set()

    def _catch_up(self) -> None:
        """A rank that comes to a running job moves past the run's newest abort notice, one
        the others recovered from before it came. Elastic: it joins a step when it trains one
        (``join_step``) but pulls now (ZeRO's replica), in the run's epoch. Fixed world (a
        restarted rank): the others' epoch, where their recovery numbered the collectives
        afresh; in epoch 0 the notice refused its first wait, and every rank recovered once
        more, blaming a server (a field run). A rank that joined a recovery is there already;
        any other is ``restarted_alone``: behind the collectives they made in that epoch."""
        if self.membership is not None:
            self.membership.catch_up()
            return
        state = self.client.run_state
        notice = state.current()
        restarted = restarts.restarted(state.took_over)
        if restarted and notice is not None and not notice.final:
            self.restart_collectives(state.next_epoch(notice))
        self.restarted_alone = restarted and not self._joined

    def _join_recovery(self) -> int:
        """A restarted rank of a fixed-world job that finds a server restarted empty (a node
        lost its trainer and its server at once): the running ranks recover from losing that
        server (``train_with_recovery``) behind barriers of the whole world, which this rank
        must reach. It moves to their epoch, past the run's newest abort notice (a recovery
        numbers its collectives afresh there, so its first barrier is this rank's first),
        meets them while rank 0 restores the job (``recover``) and returns the step restored.
        A notice older than the others' epoch (from a recovery they had made before, while
        this loss has not reached them yet) fails that meeting (their next notice aborts it, or
        its barrier was theirs, long freed): it waits for a newer one and meets them past it.
        Each wait for a notice is bounded by the client's ``timeout_s`` (they notice within
        seconds). The run's final notice (a rank given up for good) ends it: raises, as the
        others stop. Before, it took that notice's epoch, past any a lease carries, and its
        renewals failed every second while it waited out its deadline (a field check)."""
        state = self.client.run_state
        after = -1  # the epoch of the newest notice that was too old
        while True:
            notice = self._notice_after(after)
            if notice.final:  # the run ended (another rank gave it up): nobody recovers
                restarts.declare_stopped(notice.reason[:400])  # the launcher restarts it not
                raise RuntimeError(
                    f"job '{self.config.job}' holds no values on a server restarted empty, and"
                    f" the run ended: {notice.reason}"
                )
            epoch = state.next_epoch(notice)
            log.warning(
                "rank %d: job '%s' holds no values on a server restarted empty: this rank"
                " joins the running ranks' recovery (epoch %d)",
                self.rank, self.config.job, epoch,
            )  # fmt: skip
            self.restart_collectives(epoch)
            try:
                step = self.recover()
                self._joined = True
                return step
            except ShardClientError as exc:
                after = notice.epoch
                log.warning("rank %d: not their recovery's epoch (%s)", self.rank, exc.details)

    def _notice_after(self, epoch: int) -> Notice:
        """The run's abort notice of an epoch past ``epoch``, once there is one (bounded by
        the client's ``timeout_s``)."""
        state, timeout = self.client.run_state, self.client.timeout_s
        deadline = time.monotonic() + timeout
        while (notice := state.refresh()) is None or notice.epoch <= epoch:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"job '{self.config.job}' holds no values on a server restarted empty, and"
                    f" no running rank said it recovers it within {timeout:.0f} s (timeout_s):"
                    " restore a snapshot or drop the job"
                )
            time.sleep(REBUILD_POLL_S)
        return notice

    def adopt_server_version(self) -> int:
        """Continues at the version the servers hold of this job (after a restore someone
        else made, as a 3D wrapper's rank 0 does for all parts); returns it. Every rank of the
        job calls it."""
        from paramshard.client import tools

        versions = {b.version for b in tools.job_params(self.client, self.config.job)}
        if len(versions) != 1:
            raise RuntimeError(f"after restore the job is at versions {sorted(versions)}")
        self._step = versions.pop()
        self._members = None
        self._micro, self._clip_coef, self._inv_scale, self._check = 0, 1.0, 1.0, None
        self._invalidate()
        self._after_load()
        return self._step

    def restart_collectives(self, epoch: int) -> None:
        """After a failure left ranks at different collectives: numbering starts afresh in
        ``epoch`` (the same on every rank)."""
        self.client.restart_collectives(epoch)

    def abandon_step(self) -> None:
        """Drops a step that cannot finish (a server died): waits out pushes in flight,
        ignoring their errors, and forgets gradients pushed so far."""
        pending, self._pending = self._pending, []
        for fut in pending:
            try:
                fut.result()
            except Exception:  # noqa: BLE001, S110 - the step is being abandoned anyway
                pass
        self._micro, self._clip_coef, self._inv_scale, self._check = 0, 1.0, 1.0, None
        self._members = None  # elastic: the step is joined again (its members may change)
        if self.membership is not None:
            self.membership.training = None
        self._skip_reason = ""
        self._invalidate()
        self._abandon_local()

    def _abandon_local(self) -> None:
        """Strategy-specific local state of a half-done step (pushed flags, gathered units)."""

    def ensure_idle(self) -> None:
        """Waits for this rank's gradient pushes in flight; raises between a backward pass
        and its ``optimizer.step()`` (checkpoints and restores are taken between steps)."""
        self._wait_pushes()
        if self._micro:
            raise RuntimeError(
                f"{type(self).__name__}: checkpoints are taken between steps; {self._micro}"
                " backward passes are waiting for optimizer.step()"
            )


def confirm_kept(client: Any, job: str, step: int, lost: list[int]) -> None:
    """Raises a recoverable NOT_FOUND naming the first of ``lost`` (``client``'s servers). A
    server restarted empty after the job's last update goes unseen by the calls that follow
    it: a collective needs no job there, and a contribution retried after the restart
    completes on the new process. So ``train_with_recovery`` asks before it returns, and
    recovers that server rather than end with a part of the job gone. Each rank asks alone: a
    collective to agree would wait for a rank with more steps (uneven inputs), where a rank
    that ends must end, so that the servers tell that rank at once. A FSDP or ZeRO rank sees
    every server of its job, and a 3D rank every part's (strategies/hybrid_checkpoints.py)."""
    if not lost:
        return
    i = lost[0]
    raise ShardClientError(
        i, client.spec.addresses[i], "RegisterBuffer", grpc.StatusCode.NOT_FOUND,
        f"job '{job}' is not whole on this server at step {step}: it holds none of the job's"
        " values, or another step's (it restarted empty after the last update)",
    )  # fmt: skip
