"""Files ``paramshard launch`` hands to its ranks (``--config``) and keeps for them (``--log-dir``).

``--config FILE`` is read once here, so a file that is missing or does not parse stops the launch
before anything starts; every rank then gets ``PARAMSHARD_CONFIG=<absolute path>``, which
``ShardingConfiguration.from_env`` reads as its base (protos/config_file.py). Its keys and values
are checked by each rank, against the configuration's own fields and rules.

``--log-dir DIR`` writes each rank's output in torchrun's layout::

    DIR/<run_id>/attempt_<n>/<rank>/stdout.log
    DIR/<run_id>/attempt_<n>/<rank>/stderr.log

``n`` counts the restarts of that rank (``--max-restarts``; torchrun's TORCHELASTIC_RESTART_COUNT),
so a restarted rank's output goes beside its first process's, not over it. Two differences from
torchrun, both so that the path is known before the run: the directory is named by the run id
itself (torchrun adds a random suffix), and ``<rank>`` is the global rank (torchrun's is the local
one, which two hosts writing to a shared DIR would both use). As with torchrun's ``--tee 3`` the
console still shows every line as ``[rank R] LINE`` (``--redirects``: the files alone, torchrun's
``--redirects 3``); the files hold the bytes as the rank printed them. Files are appended to,
so launching again with the same ``--run-id`` (to resume) keeps the earlier output.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import IO

from paramshard.commands import EXIT_USAGE, CommandError
from paramshard.protos.config_file import CONFIG_ENV, read_config_file

__all__ = ["RankLogs", "append_line", "config_env"]


def config_env(path: str | None) -> dict[str, str]:
    """What ``--config PATH`` adds to every rank's environment, once the file reads and parses."""
    if path is None:
        return {}
    try:
        read_config_file(path)
    except ValueError as exc:
        raise CommandError(f"--config: {exc}", EXIT_USAGE) from None
    return {CONFIG_ENV: os.path.abspath(path)}


@dataclass(frozen=True)
class RankLogs:
    """Where ``--log-dir`` puts one run's rank output: ``root`` is ``DIR/<run_id>``."""

    root: str

    @classmethod
    def create(cls, log_dir: str | None, run_id: str) -> RankLogs | None:
        """None without ``--log-dir``; else makes ``DIR/<run_id>`` (an error if it cannot)."""
        if log_dir is None:
            return None
        if run_id in (".", "..") or "/" in run_id or os.sep in run_id:
            raise CommandError(
                f"--log-dir: the run id {run_id!r} cannot name a directory; choose a --run-id"
                " without '/'",
                EXIT_USAGE,
            )
        root = os.path.join(os.path.abspath(log_dir), run_id)
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise CommandError(
                f"--log-dir: cannot create {root}: {exc.strerror}", EXIT_USAGE
            ) from None
        return cls(root)

    def directory(self, rank: int, attempt: int) -> str:
        """``DIR/<run_id>/attempt_<attempt>/<rank>``."""
        return os.path.join(self.root, f"attempt_{attempt}", str(rank))

    def open(self, rank: int, attempt: int) -> tuple[IO[bytes], IO[bytes]]:
        """The (stdout.log, stderr.log) of rank ``rank``'s process number ``attempt`` (0: its
        first), unbuffered so that ``tail -f`` sees each line as the rank prints it."""
        directory = self.directory(rank, attempt)
        try:
            os.makedirs(directory, exist_ok=True)
            out = open(os.path.join(directory, "stdout.log"), "ab", buffering=0)  # noqa: SIM115
            try:
                err = open(os.path.join(directory, "stderr.log"), "ab", buffering=0)  # noqa: SIM115
            except OSError:
                out.close()
                raise
        except OSError as exc:
            raise CommandError(f"--log-dir: cannot write in {directory}: {exc.strerror}") from None
        return out, err


def append_line(log: IO[bytes], line: bytes) -> None:
    """Writes one line of a rank's output to its log file; a full disk loses the file's copy
    only (the relay goes on, so the rank never blocks on a full pipe)."""
    try:
        log.write(line)
    except (OSError, ValueError):
        pass
