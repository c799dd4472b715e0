"""A snapshot carried to another layout, weights and optimizer state: a 3D job's snapshot into
another pipeline x tensor layout, a data-parallel job's into a 3D model, a 3D one into a
data-parallel model (``load_checkpoint`` of each; torchtitan's and Megatron's checkpoints
reshard on load alike).

The servers alone read snapshots, so the snapshot is loaded beside the live job under another
name (``carry_name``: ``Restore`` with ``into``; a 3D job's parts as ``<job>.carry.pp<s>.tp<t>``).
From there each rank reads, whole (tensor-parallel parts joined through client/tensor_parts.py),
the parameters and optimizer state arrays it holds, cuts its own parts and writes them at the
snapshot's version; then the loaded copy is dropped (``restore_or_carry``).

Every optimizer state array the servers keep is one value per parameter element (Adam's
moments, SGD's momentum, Adagrad's and RMSprop's sums), so it is joined and cut as the
parameter is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from paramshard.client.checkpoints import restore
from paramshard.client.jobs import param_refs, part_param, server_jobs
from paramshard.client.shard_client import ShardClient
from paramshard.client.snapshot_layouts import OtherLayout
from paramshard.client.tensor_parts import WholeParam, find_parts, join_parts
from paramshard.protos.slicing import tensor_parallel_ranges

__all__ = ["Carried", "carry_name", "read_carried", "restore_or_carry"]


def carry_name(job: str) -> str:
    """The name a snapshot of ``job`` is loaded as while it is carried (a 3D one's parts:
    ``part_job`` of it)."""
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
    optimizer: str
    """The servers' name of the optimizer the snapshot's job had ("adamw", "sgd", ...)."""

    def whole(self, name: str, state: str = "") -> np.ndarray:
        """Parameter ``name``'s whole values (``state``: that state array's), in its shape."""
        found = self.states[state][name] if state else self.params[name]
        return found.produce().reshape(found.shape)

    def part(self, name: str, state: str, split: Mapping[str, int] | None) -> np.ndarray:
        """``whole(name, state)``, or with ``split`` (a tensor-parallel parameter's
        ``split_*`` fields) the part it gives: its ranges of the split dim, in order."""
        whole = self.whole(name, state)
        if split is None:
            return whole
        dim = split["split_dim"]
        ranges = tensor_parallel_ranges(
            whole.shape[dim], split["split_parts"], split["split_index"],
            split["split_packed"], split["split_unit"],
        )  # fmt: skip
        return np.concatenate([whole.take(r, axis=dim) for r in ranges], axis=dim)

    def misfits(
        self, shapes: Mapping[str, Sequence[int]], splits: Mapping[str, Mapping[str, int]]
    ) -> list[str]:
        """What keeps parameters ``shapes`` (name -> the shape a rank holds; ``splits``: the
        ``split_*`` fields of its tensor-parallel ones) from being cut out of these: a name
        the snapshot lacks, a whole shape whose part is not the rank's."""
        wrong = []
        for name, shape in shapes.items():
            if name not in self.params:
                wrong.append(f"'{name}' is not in the snapshot")
                continue
            whole = list(self.params[name].shape)
            want = list(whole)
            s = splits.get(name)
            if s is not None:
                dim = s["split_dim"]
                try:
                    ranges = tensor_parallel_ranges(
                        whole[dim], s["split_parts"], s["split_index"],
                        s["split_packed"], s["split_unit"],
                    )  # fmt: skip
                except (ValueError, IndexError) as exc:  # a size this split cannot cut
                    wrong.append(f"'{name}' is {whole} in the snapshot: {exc}")
                    continue
                want[dim] = sum(map(len, ranges))
            if want != list(shape):
                wrong.append(f"'{name}' is {whole} in the snapshot, {list(shape)} here")
        return wrong


def read_carried(client: ShardClient, job: str) -> Carried:
    """What the servers hold of the snapshot loaded as ``carry_name(job)``: nothing is read
    until a tensor is asked for (``Carried.whole``). A 3D job's parts are checked to fit
    together."""
    base = carry_name(job)
    held = server_jobs(client)
    parts = {(0, 0): base} if base in held.status else find_parts(base, held.jobs)
    if not parts:
        raise held.not_found(base)
    refs = {k: param_refs(held.status[name]) for k, name in parts.items()}
    buffers = [b for name in parts.values() for b in held.status[name].buffers]
    keys = sorted({k for b in buffers for k in b.state_keys})
    steps = {b.optimizer_steps for b in buffers if b.state_keys}
    versions = {b.version for b in buffers}
    optimizers = {b.optimizer for b in buffers}
    if len(steps) > 1 or len(versions) > 1 or len(optimizers) > 1:
        raise RuntimeError(
            f"the snapshot loaded as '{base}' is at versions {sorted(versions)} and optimizer"
            f" steps {sorted(steps)} of {sorted(optimizers)}: not one snapshot"
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
        optimizer=optimizers.pop() if optimizers else "",
    )


def _drop_carried(client: ShardClient, job: str) -> None:
    """Drops what is loaded as ``carry_name(job)`` from every server (also what a carry that
    failed left)."""
    base = carry_name(job)
    held = server_jobs(client)
    names = [base] if base in held.status else []
    for name in names + list(find_parts(base, held.jobs).values()):
        client.drop_job(name)


def restore_or_carry(
    client: ShardClient,
    job: str,
    tag: str,
    contributors: int,
    layout: tuple[int, int],
    take: Callable[[Carried], None],
) -> None:
    """Every rank of ``client`` calls it: rank 0 restores snapshot ``tag`` of ``job`` for a
    model of ``layout`` (``snapshot_layouts.PLAIN``, or its (stages, tensor ranks)). A snapshot of
    another layout is loaded as ``carry_name(job)`` instead, and every rank's ``take`` writes
    its part of it; then the loaded copy is dropped."""
    carried = np.zeros(1, dtype=np.int64)
    if client.rank == 0:
        try:
            restore(client, job, tag, contributors, layout)
        except OtherLayout as other:  # loaded beside the live job, to be carried
            _drop_carried(client, job)
            restore(client, job, other.tag, into=carry_name(job))
            carried[0] = 1
    if not client.broadcast(carried)[0]:
        return
    try:
        take(read_carried(client, job))
    finally:
        client.barrier()  # every rank has read what it needs
        if client.rank == 0:
            _drop_carried(client, job)
