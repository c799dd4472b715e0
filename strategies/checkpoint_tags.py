"""The tags ``train_with_recovery`` snapshots under: ``<prefix>-<step>``, with ``-e<epoch>``
after a recovery (a failure may leave a tag half-written: a 3D job's parts are committed one
by one, so a recovery never reuses one), and ``.<n>`` where the job has that tag already.

A job resumed from its snapshots (servers started with ``--restore latest``, the trainers
started again) or rolled back (``load_checkpoint`` of an older tag) trains through step
numbers it took snapshots at before: its first checkpoint used to fail with ALREADY_EXISTS
(a snapshot is written once), ending the rank that took it, while the others spent their
recoveries on a server they took for lost. The job's tags are listed once, as training starts,
by every rank (only the rank that snapshots needs them: the others pass the tag on unused).

A server started without ``--snapshot-dir`` refuses every snapshot. That is no lost server: the
rank that snapshots (rank 0, an elastic step's leader) tells the others that the run cannot go
on (a final notice) and raises a ``RuntimeError`` saying what to do. Before, it recovered as
from a lost server, five times, and so did every rank its notices reached.
"""

from __future__ import annotations

from typing import Any

from paramshard.client import ShardClientError

__all__ = ["CheckpointTags", "save"]

NO_FOLDER = "has no snapshot directory"
"""What a server without ``--snapshot-dir`` says to a Snapshot (server/snapshots/files.py)."""


class CheckpointTags:
    """The next checkpoint's tag for one ``train_with_recovery`` call."""

    def __init__(self, model: Any, prefix: str, listed: bool) -> None:
        """``listed``: whether checkpoints are taken at all (else nothing is asked)."""
        from paramshard.client import tools

        self.prefix = prefix
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


def save(model: Any, tag: str) -> None:
    """``model.save_checkpoint(tag)``; a server with no snapshot folder ends the run (above)."""
    try:
        model.save_checkpoint(tag)
    except ShardClientError as exc:
        if exc.method != "Snapshot" or NO_FOLDER not in exc.details:
            raise
        why = (
            f"cannot snapshot: server {exc.server} ({exc.address}) {NO_FOLDER}; start the"
            " servers with --snapshot-dir (shared by them), or pass checkpoint_every=0"
        )
        model.client.run_state.give_up(f"gives up: {why}", final=True)
        raise RuntimeError(f"train_with_recovery {why}") from exc
