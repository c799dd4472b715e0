"""The tags ``train_with_recovery`` snapshots under: ``<prefix>-<step>``, with ``-e<epoch>``
after a recovery (a failure may leave a tag half-written: a 3D job's parts are committed one
by one, so a recovery never reuses one), and ``.<n>`` where the job has that tag already.

A job resumed from its snapshots (servers started with ``--restore latest``, the trainers
started again) or rolled back (``load_checkpoint`` of an older tag) trains through step
numbers it took snapshots at before: its first checkpoint used to fail with ALREADY_EXISTS
(a snapshot is written once), ending the rank that took it, while the others spent their
recoveries on a server they took for lost. The job's tags are listed once, as training starts,
by every rank (only the rank that snapshots needs them: the others pass the tag on unused).

After each checkpoint the rank that took it deletes the job's older checkpoints of this prefix,
all but the ``keep_last`` taken last (torchtitan's ``keep_latest_k``), and the torn ones older
than the newest (client/snapshot_deletion.py): a job snapshotting every few hundred steps
filled its disk before, nothing ever deleting a snapshot. Only tags of this form are deleted
(``<prefix>-<step>...``, "" a prefix too): not those saved by hand (``save_checkpoint``,
``paramshard snapshot``) under other names, nor a checkpoint of another prefix. A deletion
that fails is logged, and training goes on.

A server started without ``--snapshot-dir`` refuses every snapshot. That is no lost server: the
rank that snapshots (rank 0, an elastic step's leader) tells the others that the run cannot go
on (a final notice) and raises a ``RuntimeError`` saying what to do. Before, it recovered as
from a lost server, five times, and so did every rank its notices reached. A token without the
``admin`` role (a trainer's ``train`` token) ends the run the same way, with a
``PermissionError`` saying which token it needs.
"""

from __future__ import annotations

import logging
from typing import Any

from paramshard.client import ShardClientError
from paramshard.client.unreachable import lacks_role

__all__ = ["CheckpointTags", "save"]

log = logging.getLogger("paramshard.recovery")

NO_FOLDER = "has no snapshot directory"
"""What a server without ``--snapshot-dir`` says to a Snapshot (server/snapshots/files.py)."""


class CheckpointTags:
    """The next checkpoint's tag for one ``train_with_recovery`` call."""

    def __init__(self, model: Any, prefix: str, listed: bool, keep_last: int = 0) -> None:
        """``listed``: whether checkpoints are taken at all (else nothing is asked);
        ``keep_last``: how many of them to keep (0: all)."""
        from paramshard.client import tools

        self.prefix, self.keep_last = prefix, keep_last
        self.taken: set[str] = set()
        if not listed:
            return
        job = model.config.job
        try:
            rows = tools.list_snapshots(model.config.client, job, combine_parts=True)
        except ShardClientError:  # no snapshot folder and the like: the snapshot will say so
            return
        self.taken = {r["tag"] for r in rows if r["job"] == job}

    def next(self, step: int, epoch: int) -> str:
        """The tag of a checkpoint before ``step`` in ``epoch``, not taken before."""
        tag = f"{self.prefix}-{step}" + (f"-e{epoch}" if epoch else "")
        fresh, n = tag, 1
        while fresh in self.taken:
            fresh, n = f"{tag}.{n}", n + 1
        self.taken.add(fresh)
        return fresh

    def take(self, model: Any, step: int, epoch: int) -> None:
        """A checkpoint before ``step`` in ``epoch`` (every rank calls it), then the older
        ones beyond ``keep_last`` deleted by the rank that took it."""
        save(model, self.next(step, epoch))
        if self.keep_last and _takes_snapshots(model):
            self._prune(model)

    def _prune(self, model: Any) -> None:
        from paramshard.client.snapshot_deletion import prune_snapshots

        job = model.config.job
        try:
            gone = prune_snapshots(model.config.client, job, self.keep_last, self.prefix)
        except (ShardClientError, KeyError) as exc:  # refused, a server away: next time
            log.warning("job '%s': older checkpoints were not deleted: %s", job, exc)
            return
        if gone:
            mb = sum(g["bytes"] for g in gone) / 2**20
            tags = ", ".join(g["tag"] for g in gone)
            log.info("job '%s': deleted checkpoint(s) %s (%.1f MiB)", job, tags, mb)


def _takes_snapshots(model: Any) -> bool:
    """Whether this rank took the checkpoint just saved: rank 0, or an elastic step's leader
    (``save_checkpoint``)."""
    members = model.join_step() if getattr(model, "membership", None) is not None else None
    return model.config.client.rank == (members.leader if members is not None else 0)


def save(model: Any, tag: str) -> None:
    """``model.save_checkpoint(tag)``; a server with no snapshot folder, or a token that may
    not snapshot, ends the run (above)."""
    try:
        model.save_checkpoint(tag)
    except ShardClientError as exc:
        if exc.method == "Snapshot" and NO_FOLDER in exc.details:
            why = (
                f"cannot snapshot: server {exc.server} ({exc.address}) {NO_FOLDER}; start the"
                " servers with --snapshot-dir (shared by them), or pass checkpoint_every=0"
            )
            error: Exception = RuntimeError(f"train_with_recovery {why}")
        elif lacks_role(exc.code, exc.details):
            why = (
                f"cannot snapshot: {exc}. Checkpoints, and the restores that recover from them,"
                " are admin calls: give the ranks the servers' admin token (PARAMSHARD_TOKEN;"
                " paramshard launch --token-file: a file holding only it), or pass"
                " checkpoint_every=0"
            )
            error = PermissionError(f"train_with_recovery {why}")
        else:
            raise
        model.client.run_state.give_up(f"gives up: {why}", final=True)
        raise error from exc
