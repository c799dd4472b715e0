"""The run id: which collective slots on the servers belong to one run.

All ranks of a run must agree on it, and two runs on the same servers must differ, or their
collectives would meet in the same slots. ``paramshard launch`` sets ``PARAMSHARD_RUN``. A
trainer started by torchrun has ``TORCHELASTIC_RUN_ID`` (its ``--rdzv-id``; a fresh uuid with
``--standalone`` or a single-node run), which is used when PARAMSHARD_RUN is unset. torchrun's
static default ``"none"`` is what every job that names no id gets, so it counts as unset.

Torch-free; read by ``ShardClient`` and by the launcher, so both follow one rule.
"""

from __future__ import annotations

import os

__all__ = ["RUN_ENV", "TORCHRUN_RUN_ENV", "run_id_from_env"]

RUN_ENV = "PARAMSHARD_RUN"
TORCHRUN_RUN_ENV = "TORCHELASTIC_RUN_ID"
TORCHRUN_UNSET = "none"  # torchrun's --rdzv-id default: shared by unrelated jobs


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
