"""``paramshard launch --elastic --min-nproc M``: the launcher's side of elastic data parallelism.

An elastic job's ranks may change between steps (docs/elastic.md): the servers agree each
step's members, so the launcher only has to tell the ranks (``PARAMSHARD_ELASTIC=1`` and
``PARAMSHARD_MIN_NPROC``, which ``ShardingConfiguration.from_env`` reads) and, when a rank
fails for good (not restarted: ``--max-restarts`` used up, or it never built a model), let the
others train on instead of stopping them. ``--nproc N`` is then the most ranks the job has
(each rank's ``WORLD_SIZE``); below ``M`` the ranks wait, bounded, then fail and say so.
"""

from __future__ import annotations

import argparse

from paramshard.client.membership import ELASTIC_ENV, MIN_NPROC_ENV
from paramshard.commands import EXIT_USAGE, CommandError

__all__ = ["Departures", "check", "elastic_env"]


def check(args: argparse.Namespace, world_size: int) -> None:
    """Refuses ``--min-nproc`` without ``--elastic`` or above the world size."""
    if args.min_nproc is None:
        return
    if not args.elastic:
        raise CommandError("--min-nproc needs --elastic", EXIT_USAGE)
    if args.min_nproc > world_size:
        raise CommandError(
            f"--min-nproc {args.min_nproc} is more than the job's {world_size} ranks"
            " (--nnodes x --nproc)",
            EXIT_USAGE,
        )


def elastic_env(args: argparse.Namespace) -> dict[str, str]:
    """What every rank of an elastic launch is told (nothing otherwise)."""
    if not args.elastic:
        return {}
    return {ELASTIC_ENV: "1", MIN_NPROC_ENV: str(args.min_nproc or 1)}


class Departures:
    """The ranks of an elastic launch that failed for good, and the launcher's exit code.
    ``min_nproc``: the job's minimum, where this launcher runs every rank of it (one host):
    once fewer run and none has finished, nothing can bring the job back to it (a rank that
    failed for good never comes back), so the launcher stops the job rather than let the
    others wait ``elastic_wait_s`` (600 s) in silence below it."""

    def __init__(self, min_nproc: int = 0) -> None:
        self.codes: dict[int, int] = {}  # rank -> its exit code
        self.finished = 0  # ranks that ended with 0
        self.min_nproc = min_nproc

    def leave(self, rank: int, code: int) -> None:
        self.codes[rank] = code

    def too_few(self, running: int) -> str:
        """Why the job cannot train with ``running`` ranks left, or ""."""
        if self.finished or running >= self.min_nproc:
            return ""
        return (
            f"{running} rank(s) left, fewer than --min-nproc {self.min_nproc}, and none can"
            " come back (the others failed for good)"
        )

    def exit_code(self) -> int:
        """0 when some rank finished the job; else the first failed rank's code."""
        if self.finished or not self.codes:
            return 0
        return next(iter(self.codes.values()))
