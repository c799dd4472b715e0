"""The run id: which collective slots on the servers belong to one run.

All ranks of a run must agree on it, and two runs on the same servers must differ, or their
collectives would meet in the same slots. ``paramshard launch`` sets ``PARAMSHARD_RUN``. A
trainer started by torchrun has ``TORCHELASTIC_RUN_ID`` (its ``--rdzv-id``; a fresh uuid with
``--standalone`` or a single-node run), which is used when PARAMSHARD_RUN is unset. torchrun's
static default ``"none"`` is what every job that names no id gets, so it counts as unset.

When neither names a run, a strategy's configuration (``ShardingConfiguration.from_env``)
runs under its job's name (``job_run_id``). Two jobs on shared servers then keep their
collectives apart, where both used to take ``"run"`` and their sums mixed one job's ranks with
the other's (silently for the ranks that came first); and a token scoped to the job covers
the run (docs/security.md). A client made by hand without a run id is in ``"run"``, and says
so once a process when it has peers.

Torch-free; read by ``ShardClient`` and by the launcher, so both follow one rule.
"""

from __future__ import annotations

import logging
import os
import re
import threading

__all__ = [
    "RUN_ENV",
    "TORCHRUN_RUN_ENV",
    "UNNAMED",
    "job_run_id",
    "run_id_for",
    "run_id_from_env",
    "say_unnamed",
]

log = logging.getLogger("paramshard")

RUN_ENV = "PARAMSHARD_RUN"
TORCHRUN_RUN_ENV = "TORCHELASTIC_RUN_ID"
TORCHRUN_UNSET = "none"  # torchrun's --rdzv-id default: shared by unrelated jobs
UNNAMED = "run"  # a client's run when nothing names one


def run_id_from_env() -> str | None:
    """``PARAMSHARD_RUN``, else torchrun's ``TORCHELASTIC_RUN_ID`` unless it is ``"none"``;
    None when neither names a run (empty values count as unset)."""
    ours = os.environ.get(RUN_ENV, "").strip()
    if ours:
        return ours
    theirs = os.environ.get(TORCHRUN_RUN_ENV, "").strip()
    if theirs and theirs != TORCHRUN_UNSET:
        return theirs
    return None


def run_id_for(job: str | None = None) -> str:
    """The run of a client given none: the environment's, else ``job``'s (a strategy's
    configuration knows its job), else ``UNNAMED``."""
    return run_id_from_env() or (job_run_id(job) if job else UNNAMED)


def job_run_id(job: str) -> str:
    """The run of a job whose environment names none: the job's name (``[A-Za-z0-9_.-]+``),
    with ``-run`` after one that ends as a restarted run's does (``.e<digits>``, a collective
    epoch: server/collectives/pending.py), so that it is not read as one."""
    return f"{job}-run" if re.search(r"\.e\d+$", job) else job


_said = threading.Event()


def say_unnamed() -> None:
    """Warns, once a process, that a client with peers is in the run nobody named."""
    if _said.is_set():
        return
    _said.set()
    log.warning(
        "no run id (%s, or torchrun's --rdzv-id): this client's collectives are in run %r,"
        " which every other job on these servers without one shares, and their sums would mix"
        " with this job's; give each job its own (ShardClient(run_id=...); a strategy's"
        " ShardingConfiguration.from_env takes its job's)",
        RUN_ENV,
        UNNAMED,
    )
