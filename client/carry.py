"""A 3D job's snapshot carried to another pipeline x tensor layout: weights and optimizer state.

A snapshot of ``<job>.pp<s>.tp<t>`` parts holds each part's slices; the model that loads it
may split its stages and tensors otherwise. The servers read snapshots, so the snapshot is
loaded beside the live job under another base name (``carry_name``: ``Restore`` with ``into``,
each part as ``<job>.carry.pp<s>.tp<t>``). From there each rank reads, whole (tensor-parallel
parts joined through client/tensor_parts.py), the parameters and optimizer state arrays its
own stage holds, and cuts its own parts; then the loaded copy is dropped.

Every optimizer state array the servers keep is one value per parameter element (Adam's
moments, SGD's momentum, Adagrad's and RMSprop's sums), so it is joined and cut as the
parameter is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from paramshard.client.jobs import param_refs, part_param, server_jobs
from paramshard.client.shard_client import ShardClient
from paramshard.client.tensor_parts import WholeParam, find_parts, join_parts

__all__ = ["Carried", "carry_name", "drop_carried", "read_carried"]


def carry_name(job: str) -> str:
    """The base name snapshot parts of ``job`` are loaded as while they are carried."""
    return f"{job}.carry"


@dataclass
class Carried:
    """A loaded snapshot's whole tensors, by every name a parameter has (tied ones too)."""

    params: dict[str, WholeParam]
    states: dict[str, dict[str, WholeParam]]
    """State array (torch's key, e.g. "exp_avg") -> parameter name -> its whole array."""
    steps: int
    """The optimizer's step count (0, and no states, before its first step)."""
    version: int

    def whole(self, name: str, state: str = "") -> np.ndarray:
        """Parameter ``name``'s whole values (``state``: that state array's), in its shape."""
        found = self.states[state][name] if state else self.params[name]
        return found.produce().reshape(found.shape)


def read_carried(client: ShardClient, job: str) -> Carried:
    """What the servers hold of the parts loaded as ``carry_name(job)``: nothing is read
    until a tensor is asked for (``Carried.whole``). The parts are checked to fit together."""
    base = carry_name(job)
    held = server_jobs(client)
    parts = find_parts(base, held.jobs)
    if not parts:
        raise held.not_found(base)
    refs = {k: param_refs(held.status[name]) for k, name in parts.items()}
    buffers = [b for name in parts.values() for b in held.status[name].buffers]
    keys = sorted({k for b in buffers for k in b.state_keys})
    steps = {b.optimizer_steps for b in buffers if b.state_keys}
    versions = {b.version for b in buffers}
    if len(steps) > 1 or len(versions) > 1:
        raise RuntimeError(
            f"the parts loaded as '{base}' are at versions {sorted(versions)} and optimizer"
            f" steps {sorted(steps)}: not one snapshot"
        )

    def joined(state: str) -> dict[str, WholeParam]:
        params = {
            k: [part_param(held.view(parts[k]), parts[k], r, state=state) for r in rs]
            for k, rs in refs.items()
        }
        whole = join_parts(base, params, parts)
        return {n: w for w in whole for n in (w.name, *w.aliases)}

    return Carried(
        params=joined(""),
        states={key: joined(key) for key in keys},
        steps=steps.pop() if steps else 0,
        version=versions.pop() if versions else 0,
    )


def drop_carried(client: ShardClient, job: str, names: Iterable[str] | None = None) -> None:
    """Drops the parts loaded as ``carry_name(job)`` from every server (also those a carry
    that failed left)."""
    base = carry_name(job)
    for name in names if names is not None else find_parts(base, server_jobs(client).jobs).values():
        client.drop_job(name)
