"""An elastic job's checkpoints and recovery: taken by a step's members, not by the world.

Without elasticity every rank meets at barriers over the world and rank 0 acts
(strategies/data_parallel/checkpoints.py). An elastic job's world is whoever trains now, so:

- a snapshot is taken *before* a step, by that step's members: the lowest member snapshots the
  servers' version while the others wait at the step group's barrier;
- a restore is made the same way, between two such barriers;
- after a failure (``resync``), the servers are brought back to one version, by facts rather
  than by who failed: if they agree (or differ by one step whose Step this rank sent, which it
  sends again), the rank adopts that version; otherwise the ranks hold a recovery round on the
  coordinator (server/collectives/membership.py, step 7) whose leader restores the job from
  neighbour replicas or the newest snapshot while the others wait for it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc

from paramshard.client import ShardClientError
from paramshard.protos import shard_pb2 as pb

__all__ = ["ElasticCheckpoints", "JobLost", "job_versions"]

log = logging.getLogger("paramshard.recovery")

SETTLE_S = 0.2  # between looks at the servers while another rank finishes a half-applied step
NO_SNAPSHOT = {
    grpc.StatusCode.NOT_FOUND: "has no complete snapshot",
    grpc.StatusCode.FAILED_PRECONDITION: "has no snapshot directory",
}
"""What a server's refusal to restore the newest snapshot says when there is none to restore
(server/snapshots/files.py): none of the job, or no snapshot directory at all."""


class JobLost(RuntimeError):
    """No server holds the job, no replica covers it and no snapshot of it exists: nothing
    recovers it (not a ``ShardClientError``, so ``train_with_recovery`` stops at once)."""


def job_versions(client: Any, job: str) -> list[int | None]:
    """Each server's version of ``job`` (its slices' lowest), None where it does not hold the
    job whole and initialised (a server that came back empty)."""
    return [server_versions(client, i).get(job) for i in range(client.num_servers)]


def server_versions(client: Any, server: int) -> dict[str, int | None]:
    """Server ``server``'s version of each job it holds, as ``job_versions`` says it."""
    out: dict[str, int | None] = {}
    for row in client.call(server, "Status", pb.StatusRequest()).jobs:
        ready = row.buffers and all(b.initialized for b in row.buffers)
        out[row.job] = min(b.version for b in row.buffers) if ready else None
    return out


class ElasticCheckpoints:
    """Mixed into ``ServerCheckpoints``: the elastic variants, every member at the same point."""

    client: Any
    config: Any
    membership: Any
    _step: int
    _last_step: Any
    _loaded: tuple[str, float] | None = None
    """The tag this process last restored (``load_checkpoint``; not "latest") and when: a
    recovery restores it rather than a snapshot taken before it (``tools.recovery_tag``)."""

    def _elastic_save(self, tag: str) -> int:
        from paramshard.client import tools

        self.ensure_idle()
        members = self.join_step()
        version = self._step
        if self.client.rank == members.leader:
            version = tools.snapshot(self.client, self.config.job, tag)["version"]
        self.step_group().barrier()
        return version

    def _elastic_load(self, tag: str) -> int:
        from paramshard.client import tools

        self.ensure_idle()
        members = self.join_step()
        group = self.step_group()
        group.barrier()  # nobody still reads the old state when the leader replaces it
        if self.client.rank == members.leader:
            job, world = self.config.job, self.world_size
            self._restore(lambda: tools.restore(self.client, job, tag, contributors=world))
        group.barrier()
        self._loaded = None if tag == "latest" else (tag, time.time())
        return self.resync(self.client.run_state.epoch, 0.0)

    def _restore(self, restore: Any) -> None:
        from paramshard.client import tools

        restore()
        if self.config.replicate_every:
            tools.configure_replication(self.client, self.config.job, self.config.replicate_every)

    def _recover_job(self) -> None:
        """The leader's part of a recovery round (and rank 0's in a fixed world): the job
        back on every server from neighbour replicas, else the newest snapshot; replication
        configured again."""
        self._restore(self._restore_newest)

    def _restore_newest(self) -> None:
        """Neighbour replicas, else the newest snapshot; ``JobLost`` when neither holds the
        job. This rank then tells the others (an abort notice: a rank waiting for this
        restore stops waiting) and the launcher (not to restart it: a new process would
        train the job anew from step 0)."""
        from paramshard.client import restarts, tools

        job = self.config.job
        try:
            if not self.config.replicate_every:
                raise LookupError("replication is off")
            tools.recover_from_replicas(self.client, job)
        except LookupError as no_replica:
            if self.config.replicate_every:
                log.warning(
                    "job '%s': no usable replica (%s): restoring the newest snapshot",
                    job,
                    no_replica,
                )
            try:
                tag = tools.recovery_tag(self.client, job, self._loaded)
                tools.restore(self.client, job, tag, contributors=self.world_size)
            except ShardClientError as exc:
                phrase = NO_SNAPSHOT.get(exc.code)
                if phrase is None or phrase not in exc.details:
                    raise
                lost = JobLost(
                    f"job '{job}' cannot be recovered: {no_replica}, and {exc.details}:"
                    " its state is lost with the servers that held it (replicate_every"
                    " keeps a copy on a neighbour, checkpoint_every snapshots)"
                )
                restarts.declare_lost(job)
                self.client.run_state.give_up(f"gives up: {lost}", final=True)
                raise lost from exc

    def _recovery_round(self, epoch: int) -> None:
        """Takes part in ``epoch``'s recovery round: restores the job when this rank leads it,
        else returns once its leader did."""
        if self.membership.recovery(epoch):
            self._recover_job()
            self.membership.recovered()

    def resync(self, epoch: int, settle_s: float) -> int:
        """After a failure (every rank calls it, in its new ``epoch``): brings the servers to
        one version of the job and continues there; returns that step. ``settle_s``: how long
        to let another rank finish a step half applied before restoring instead."""
        job = self.config.job
        waited, rebuilt, deadline = 0.0, False, None
        while True:
            versions = job_versions(self.client, job)
            known = [v for v in versions if v is not None]
            low = min(known, default=None)
            if len(known) == len(versions) and max(known) == low:
                break
            last = self._last_step
            if len(known) == len(versions) and max(known) == low + 1:
                if last is not None and last[0] == low:  # this rank's own Step, sent again
                    step, args, skip = last
                    self.client.step(job, step, args, skip=skip)
                    continue
                if waited < settle_s:  # another member may hold that Step's arguments
                    time.sleep(SETTLE_S)
                    waited += SETTLE_S
                    continue
            if rebuilt and None in versions:  # restored in this epoch, and a server lost it
                raise self._lost_again(epoch, versions)
            if rebuilt:  # the round is done and the others train on: look again, paced
                deadline = deadline or time.monotonic() + self.client.timeout_s
                if time.monotonic() > deadline:
                    raise self._never_agree(epoch, known)
                time.sleep(SETTLE_S)
            self._recovery_round(epoch)  # done: answers at once (or moves to a newer round)
            rebuilt = True
        self._adopt_step(low)
        return low

    def _never_agree(self, epoch: int, versions: list[int]) -> ShardClientError:
        """The servers still hold the job at different versions ``timeout_s`` after ``epoch``'s
        recovery round restored it: the ranks that train on should have brought them to one
        step within a step's time. A new recovery, in a new epoch, restores them again."""
        return self._seen_at(
            versions.index(max(versions)),
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"job '{self.config.job}' is still at versions {versions} on the servers"
            f" {self.client.timeout_s:.0f} s after the recovery of epoch {epoch} restored it:"
            " recovering in a new epoch",
        )

    def _seen_at(self, server: int, code: grpc.StatusCode, details: str) -> ShardClientError:
        """The failure a look at the servers (Status) found at ``server``."""
        return ShardClientError(server, self.client.spec.addresses[server], "Status", code, details)

    def _lost_again(self, epoch: int, versions: list[int | None]) -> ShardClientError:
        """A server holds no values after ``epoch``'s recovery round restored the job: it was
        lost again (a restart, empty). That round is done and restores nothing more, so the
        rank recovers again, in a new epoch (strategies/recovery_rounds.py): looking again in
        this one would loop for good."""
        return self._seen_at(
            versions.index(None),
            grpc.StatusCode.ABORTED,
            f"job '{self.config.job}' is at versions {versions} on the servers after the"
            f" recovery of epoch {epoch} restored it (None: holds no values): a server was"
            " lost again; recovering in a new epoch",
        )
