"""A snapshot carried to another layout, weights and optimizer state: a 3D job's snapshot into
another pipeline x tensor layout, a data-parallel job's into a 3D model, a 3D one into a
data-parallel model (``load_checkpoint`` of each; torchtitan's and Megatron's checkpoints
reshard on load alike).

The servers alone read snapshots, so the snapshot is loaded beside the live job under another
name (``carry_name``: ``Restore`` with ``into``; a 3D job's parts as ``part_job`` of it). From
there each rank checks that it fits and reads, whole (tensor-parallel parts joined through
client/tensor_parts.py), the parameters and optimizer state arrays it writes, cut to its own
parts; once every rank has, they write at the snapshot's version, and the loaded copy is
dropped (``restore_or_carry``).

Every optimizer state array the servers keep is one value per parameter element (Adam's
moments, SGD's momentum, Adagrad's and RMSprop's sums), so it is joined and cut as the
parameter is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from paramshard.client.checkpoints import restore
from paramshard.client.drop import drop
from paramshard.client.jobs import param_refs, part_param, server_jobs
from paramshard.client.rpc import ShardClientError
from paramshard.client.shard_client import ShardClient
from paramshard.client.snapshot_layouts import OtherLayout
from paramshard.client.tensor_parts import WholeParam, find_parts, join_parts
from paramshard.protos.placement import parse_part_job
from paramshard.protos.slicing import tensor_parallel_ranges
from paramshard.protos.words import listed

__all__ = ["Carried", "carry_name", "read_carried", "restore_or_carry"]

log = logging.getLogger("paramshard.carry")


def carry_name(job: str, run: str) -> str:
    """The name a snapshot of ``job`` is loaded as while run ``run`` carries it (a 3D one's
    parts: ``part_job`` of it). The run's own: a retry drops what its failed attempt left,
    and nothing of another run or job."""
    return f"{job}.carry-{run}"


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
        wrong, absent = [], [name for name in shapes if name not in self.params]
        if absent:  # a count and a few of each side: a model of other names lists dozens
            others = [repr(n) for n in sorted(set(self.params) - set(shapes))]
            verb = "is" if len(absent) == 1 else "are"
            wrong.append(
                f"{listed([repr(n) for n in absent], most=3)} {verb} not in the snapshot (its"
                f" other names: {listed(others, most=3)})"
            )
        for name, shape in shapes.items():
            if name not in self.params:
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


def read_carried(client: ShardClient, base: str) -> Carried:
    """What the servers hold of the snapshot loaded as ``base`` (``carry_name``): nothing is
    read until a tensor is asked for (``Carried.whole``). A 3D job's parts are checked to fit
    together."""
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


def _drop_copy(client: ShardClient, base: str) -> None:
    """Drops the copy loaded as ``base``, if any. A server that cannot drop it is logged, not
    raised: it is this run's name, and its next carry drops it first."""
    try:
        drop(client, base)
    except KeyError:
        pass  # nothing loaded
    except (ShardClientError, RuntimeError) as exc:
        log.warning("the copy '%s' a carry loaded stays on the servers: %s", base, exc)


def restore_or_carry(
    client: ShardClient,
    job: str,
    tag: str,
    contributors: int,
    layout: tuple[int, int],
    prepare: Callable[[Carried], Callable[[], None]],
) -> None:
    """Every rank of ``client`` calls it: rank 0 restores snapshot ``tag`` of ``job`` for a
    model of ``layout`` (``snapshot_layouts.PLAIN``, or its (stages, tensor ranks)). A
    snapshot of another layout is loaded as ``carry_name`` instead, and each rank's
    ``prepare`` checks that it fits and reads what the rank writes, returning the writing.
    Every rank prepares before any writes: a rank that cannot (the snapshot does not fit, a
    read failed) stops them all, the live job untouched. Then the copy is dropped."""
    base = carry_name(job, client.run_id)
    # element 0: 1 loaded to carry, -1 rank 0 failed; then rank 0's error's words, a byte each
    said, error = np.zeros(1 + _WORDS, dtype=np.int64), None
    if client.rank == 0:
        try:
            try:
                restore(client, job, tag, contributors, layout)
            except OtherLayout as other:  # loaded beside the live job, to be carried
                _drop_copy(client, base)  # what this run's failed attempt may have left
                _name_strays(client, job, base)
                restore(client, job, other.tag, into=base)
                said[0] = 1
        except Exception as exc:  # noqa: BLE001 - said to every rank, raised below
            error, words = exc, _words(exc).encode()[:_WORDS]
            said[0], said[1 : 1 + len(words)] = -1, np.frombuffer(words, dtype=np.uint8)
    said = client.broadcast(said)
    if error is not None:
        raise error
    status = int(said[0])
    if status < 0:
        words = bytes(said[1:].astype(np.uint8)).rstrip(b"\0").decode(errors="replace")
        raise RuntimeError(
            f"load_checkpoint: rank 0 could not restore snapshot '{tag}' of job '{job}':"
            f" {words}; nothing changed"
        )
    if status == 0:
        return
    write, error = None, None
    try:
        write = prepare(read_carried(client, base))
    except Exception as exc:  # noqa: BLE001 - every rank learns of it before any writes
        error = exc
    failed = _vote(client, error is None)
    if not failed and write is not None:
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - every rank learns of it
            error = exc
        failed = _vote(client, error is None)
        what = "and the job may be half written: load again"
    else:
        what = "before any rank wrote"
    if client.rank == 0:
        _drop_copy(client, base)  # every rank is past its reads
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"load_checkpoint: another rank could not carry snapshot '{tag}' of job '{job}'"
            f" to this model (its error says why), {what}"
        )


_WORDS = 1024
"""How much of rank 0's error the other ranks are told (bytes of its UTF-8)."""


def _words(exc: BaseException) -> str:
    """``exc`` in one line: its type and message (a KeyError's message, not its quoting)."""
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
    return f"{type(exc).__name__}: {text}"


def _name_strays(client: ShardClient, job: str, base: str) -> None:
    """Logs the copies other runs' carries of ``job`` left (a process killed meanwhile): the
    servers hold them until someone drops them."""
    copies = [j for j in server_jobs(client).jobs if j.startswith(f"{job}.carry-")]
    strays = sorted({(parse_part_job(j) or (j,))[0] for j in copies} - {base})
    for stray in strays:
        log.warning(
            "the servers hold '%s', a copy another run's carry of job '%s' left; it takes"
            " their memory until dropped: paramshard drop %s",
            stray,
            job,
            stray,
        )


def _vote(client: ShardClient, ok: bool) -> int:
    """How many ranks were not ``ok``: every rank reaches it, ok or not."""
    return int(client.all_reduce(np.array([0 if ok else 1], dtype=np.int64))[0])
