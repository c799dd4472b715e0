"""The snapshot manifest: what a snapshot holds, readable without the model's code or servers.

Written by the client that takes the snapshot (it alone sees every server's shard), read by
servers restoring it and by offline export.

``ParamEntry`` is the one record of a parameter inside a flat buffer (name, shape, dtype,
offset, aliases, tensor-parallel split): the torch layout plans it, the client registers it
(shard.proto's ParamEntry), the servers keep it, snapshots write it as JSON and export reads
it back. Classes that know more about a parameter (its live buffer, how to read its values)
extend it with that and nothing else.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paramshard.protos import shard_pb2 as pb
from paramshard.protos.placement import recorded_placement, restore_placement

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; annotations only (3.10 is supported)

__all__ = [
    "FORMAT",
    "MODEL_CONFIG_MAX_BYTES",
    "ParamEntry",
    "ParamSplit",
    "check_model_config",
    "new_manifest",
    "recorded_placement",
    "recorded_model_config",
    "recorded_parts",
    "restore_placement",
    "shard_name",
    "taken_order",
]

FORMAT = "paramshard-snapshot/1"

MODEL_CONFIG_MAX_BYTES = 1 << 20
"""Largest model description a server keeps (RegisterBufferRequest.model_config, UTF-8): a
Hugging Face config is a few KiB; this bounds what any client can make a server store."""
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPLIT_KEYS = ("split_dim", "split_parts", "split_index", "split_packed", "split_unit")
_ENTRY_KEYS = frozenset(("name", "shape", "dtype", "offset", "numel", "aliases") + _SPLIT_KEYS)


@dataclass(frozen=True)
class ParamSplit:
    """How a parameter entry is one part of a tensor cut by tensor parallelism (the split_*
    fields of shard.proto's ParamEntry; ``protos.slicing.tensor_parallel_ranges`` says which
    ranges of the whole tensor the part holds)."""

    dim: int
    """The tensor dim that is split."""
    parts: int
    """How many parts the whole tensor is cut into (the tensor-parallel size, > 1)."""
    index: int
    """This part's index (its tensor rank)."""
    packed: int = 1
    """Equal blocks side by side along ``dim`` (3 for a fused q|k|v); each part holds its
    share of every block, in block order."""
    unit: int = 1
    """Parts hold whole units of this many elements (a head's width)."""

    @classmethod
    def from_fields(cls, fields: Any) -> ParamSplit | None:
        """The split of ``fields`` (a manifest entry's ``split_*`` keys, a dict of them, or a
        protobuf ParamEntry); None for a whole tensor (split_parts 0 or 1). A packed or unit
        of 0 means 1, as on the wire."""
        if isinstance(fields, Mapping):
            dim, parts, index, packed, unit = (fields.get(k, 0) for k in _SPLIT_KEYS)
        else:
            dim, parts, index, packed, unit = (getattr(fields, k) for k in _SPLIT_KEYS)
        if parts <= 1:
            return None
        return cls(dim, parts, index, packed or 1, unit or 1)

    def fields(self) -> dict[str, int]:
        """The ``split_*`` fields, as manifests and shard.proto's ParamEntry carry them."""
        values = (self.dim, self.parts, self.index, self.packed, self.unit)
        return dict(zip(_SPLIT_KEYS, values, strict=True))


@dataclass(frozen=True)
class ParamEntry:
    """One original parameter inside a flat buffer: what anyone needs to cut it out of the
    buffer and give it back its shape and names, without the model's code."""

    name: str
    """Name in ``model.named_parameters()``; for a tied parameter, its first name."""
    shape: tuple[int, ...]
    """Shape of the parameter (of this part, for a tensor-parallel part)."""
    offset: int = 0
    """First element in the flat buffer."""
    dtype: str = "float32"
    """The parameter's own dtype, e.g. "bfloat16", whatever dtype the flat buffer uses."""
    aliases: tuple[str, ...] = ()
    """Other names of the same tensor (tied weights), so export writes it under each."""
    split: ParamSplit | None = None
    """Which part of a tensor-parallel tensor this is; None: the whole tensor."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @classmethod
    def from_manifest(cls, entry: Mapping[str, Any], **extra: Any) -> Self:
        """The entry of a manifest's ``params`` list (``to_manifest``'s inverse); ``extra``:
        the fields a subclass adds. ValueError for a key no entry has."""
        unknown = sorted(set(entry) - _ENTRY_KEYS)
        if unknown:
            raise ValueError(
                f"parameter entry {entry.get('name')!r} has unknown field(s) {unknown};"
                f" entries have {sorted(_ENTRY_KEYS)}"
            )
        return cls(
            entry["name"],
            tuple(entry["shape"]),
            entry.get("offset", 0),
            entry.get("dtype", "float32"),
            tuple(entry.get("aliases", ())),
            ParamSplit.from_fields(entry),
            **extra,
        )

    @classmethod
    def from_pb(cls, entry: pb.ParamEntry, **extra: Any) -> Self:
        """The entry of a shard.proto ParamEntry (``to_pb``'s inverse)."""
        return cls(
            entry.name,
            tuple(entry.shape),
            entry.offset,
            entry.dtype,
            tuple(entry.aliases),
            ParamSplit.from_fields(entry),
            **extra,
        )

    def to_manifest(self) -> dict[str, Any]:
        """The JSON object a manifest's ``params`` list holds (split fields only for a part)."""
        out: dict[str, Any] = {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "offset": self.offset,
            "numel": self.numel,
            "aliases": list(self.aliases),
        }
        if self.split is not None:
            out.update(self.split.fields())
        return out

    def to_pb(self) -> pb.ParamEntry:
        """As RegisterBufferRequest.params carries it."""
        return pb.ParamEntry(
            name=self.name,
            shape=self.shape,
            dtype=self.dtype,
            offset=self.offset,
            numel=min(self.numel, 2**64 - 1),  # a shape too large for it: the server refuses
            aliases=self.aliases,
            **(self.split.fields() if self.split is not None else {}),
        )


def check_model_config(text: str) -> dict[str, Any]:
    """The model description ``text`` (JSON: {"architecture": class name, "config": object})
    parsed, or ValueError saying what is wrong with it."""
    size = len(text.encode())
    if size > MODEL_CONFIG_MAX_BYTES:
        raise ValueError(
            f"model_config is {size:,} bytes, over the limit of {MODEL_CONFIG_MAX_BYTES:,}"
        )
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"model_config is not JSON ({exc})") from None
    if not isinstance(value, dict) or not isinstance(value.get("config"), dict):
        raise ValueError('model_config must be a JSON object with a "config" object')
    architecture = value.get("architecture")
    if not isinstance(architecture, str) or not _CLASS_NAME.fullmatch(architecture):
        raise ValueError(f'model_config "architecture" must be a class name, got {architecture!r}')
    return value


def shard_name(index: int, num: int) -> str:
    """The file of shard ``index`` of a snapshot taken on ``num`` servers."""
    return f"shard-{index}-of-{num}.safetensors"


def new_manifest(
    job: str,
    tag: str,
    version: int,
    num_servers: int,
    buffers: dict[str, Any],
    shards: list[dict[str, Any]],
    servers: list[int] | None = None,
    cluster_servers: int | None = None,
    model_config: str = "",
) -> dict[str, Any]:
    """``buffers``: name -> {numel, contributors, optimizer: {name, hyper}, params: [entries]};
    ``shards``: [{file, server, bytes, sha256}] in slice order (``server`` is the slice's
    index); ``servers``: which server of the cluster (``cluster_servers`` of them) held each
    slice, so a restore into the same cluster puts every slice back where it was (default:
    slice i on server i); ``model_config``: the job's JobStatus.model_config, recorded as the
    object it holds when not empty."""
    manifest = {
        "format": FORMAT,
        "job": job,
        "tag": tag,
        "version": version,
        "num_servers": num_servers,
        "created_unix": time.time(),
        "buffers": buffers,
        "shards": shards,
        "servers": list(range(num_servers)) if servers is None else list(servers),
        "cluster_servers": num_servers if cluster_servers is None else cluster_servers,
    }
    if model_config:
        manifest["model_config"] = check_model_config(model_config)
    return manifest


def taken_order(row: Mapping[str, Any]) -> tuple[float, int]:
    """How snapshots are ordered, oldest first, and so what "latest" is, everywhere: by when
    each was taken (its manifest's ``created_unix``), then by version. The snapshot taken last
    is the newest of the job's history as it is now: after a rollback (a job restored to step
    5 and trained on, snapshotted at 6 and 8) the tag taken at 10 before it belongs to the
    history given up, and ordered by version it was "latest", restored by every recovery and
    `--restore latest`, and the steps trained since were lost without a word."""
    return (float(row["created_unix"]), int(row["version"]))


def recorded_model_config(manifest: Mapping[str, Any]) -> str:
    """The model description a manifest recorded, as RegisterBufferRequest.model_config
    carries it (JSON text); "" when there is none."""
    value = manifest.get("model_config")
    return json.dumps(value, separators=(",", ":")) if value is not None else ""


def recorded_parts(manifest: Mapping[str, Any]) -> list[str]:
    """Of a 3D job's part snapshot: every part its job had when it was taken
    (``{"hybrid": {"parts": [...]}}``, written by ``client.checkpoints``); [] otherwise."""
    hybrid = manifest.get("hybrid")
    parts = hybrid.get("parts") if isinstance(hybrid, Mapping) else None
    if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
        return []
    return list(parts)
