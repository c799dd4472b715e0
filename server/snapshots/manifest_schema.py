"""What a snapshot manifest must hold before a server commits, lists or restores it.

``check_manifest`` raises ``ManifestError`` naming the first field that is missing or wrong, so
``CommitSnapshot`` refuses a bad manifest with INVALID_ARGUMENT and a listing skips (and
reports) one that got onto the disk some other way, instead of failing for every job.

A committed manifest (``strict``) also names its own tag and has one shard per slice, named
as the servers write them; a listed one only needs what listing and restoring read (and is
known by its folder's tag).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from paramshard.protos import shard_pb2 as pb
from paramshard.protos.codec import MASTER_DTYPES
from paramshard.protos.manifest import (
    FORMAT,
    ParamEntry,
    check_model_config,
    recorded_model_config,
    shard_name,
)
from paramshard.protos.placement import MAX_SERVERS
from paramshard.protos.slicing import shape_elements
from paramshard.server.runtime.request_bounds import MAX_VERSION

__all__ = ["ManifestError", "check_manifest"]

_PARAM_INTS = (
    "offset",
    "numel",
    "split_dim",
    "split_parts",
    "split_index",
    "split_packed",
    "split_unit",
)
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestError(ValueError):
    """A manifest field is missing or wrong; the message names it."""


U64 = 2**64 - 1  # the wire's uint64 (SnapshotInfo, registrations)


def _is_int(value: Any, minimum: int = 0, maximum: int = U64) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum


def _int(obj: dict, key: str, where: str, minimum: int = 0, maximum: int = U64) -> int:
    value = obj.get(key)
    if not _is_int(value, minimum, maximum):
        raise ManifestError(
            f"{where}{key} must be an integer in {minimum}..{maximum}, got {value!r}"
        )
    return value


def _finite(value: Any) -> bool:
    """A JSON number a float can hold (JSON integers have no bound: 10**400 is not one)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _field(obj: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ManifestError(f"{where}{key} must be a {names}, got {value!r}")
    return value


def _check_buffer(name: str, info: Any) -> None:
    where = f"buffers.{name}."
    if not isinstance(info, dict):
        raise ManifestError(f"buffers.{name} must be an object, got {info!r}")
    numel = _int(info, "numel", where)
    _int(info, "contributors", where, minimum=1)
    if "master_dtype" in info and info["master_dtype"] not in MASTER_DTYPES:
        raise ManifestError(
            f"{where}master_dtype must be one of {', '.join(MASTER_DTYPES)},"
            f" got {info['master_dtype']!r}"
        )
    optimizer = _field(info, "optimizer", dict, where)
    _field(optimizer, "name", str, f"{where}optimizer.")
    hyper = _field(optimizer, "hyper", dict, f"{where}optimizer.")
    for key, value in hyper.items():
        if not _finite(value):
            raise ManifestError(
                f"{where}optimizer.hyper.{key} must be a finite number, got {value!r}"
            )
    try:  # what a restore makes of it
        pb.RegisterBufferRequest(
            numel=numel,
            contributors=info["contributors"],
            optimizer=pb.OptimizerSpec(name=optimizer["name"], hyper=hyper),
        )
    except (TypeError, ValueError) as exc:
        raise ManifestError(f"buffers.{name} does not fit a registration ({exc})") from None
    for i, p in enumerate(_field(info, "params", list, where)):
        at = f"{where}params[{i}]."
        if not isinstance(p, dict):
            raise ManifestError(f"{where}params[{i}] must be an object, got {p!r}")
        _field(p, "name", str, at)
        shape = _field(p, "shape", list, at)
        if not all(_is_int(d) for d in shape):
            raise ManifestError(f"{at}shape must be integers >= 0, got {shape!r}")
        for key in _PARAM_INTS:
            if key in p:
                _int(p, key, at)
        elements = shape_elements(shape, numel)  # before anything multiplies the dims out
        if p.get("offset", 0) + p.get("numel", 0) > numel or elements != p.get("numel", 0):
            raise ManifestError(
                f"{at[:-1]} (shape {shape}, offset {p.get('offset', 0)}) does not fit the"
                f" buffer's {numel} elements"
            )
        try:  # what a restore makes of it
            ParamEntry.from_manifest(p).to_pb()
        except (TypeError, ValueError) as exc:
            raise ManifestError(f"{at[:-1]} is not a parameter entry ({exc})") from None


def check_manifest(manifest: Any, job: str, tag: str, *, strict: bool = False) -> dict[str, Any]:
    """``manifest`` (parsed JSON) if it is a manifest of snapshot ``job/tag``, else
    ManifestError naming the field."""
    if not isinstance(manifest, dict):
        raise ManifestError(f"a manifest is a JSON object, not {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise ManifestError(f"format must be {FORMAT!r}, got {manifest.get('format')!r}")
    # A listed or restored snapshot is known by its folder: a copied folder keeps the tag
    # it was committed under, so only a commit must name its own tag.
    for key, expected in (("job", job), ("tag", tag))[: 2 if strict else 1]:
        if manifest.get(key) != expected:
            raise ManifestError(
                f"{key} is {manifest.get(key)!r}, but the snapshot folder is '{job}/{tag}'"
            )
    _int(manifest, "version", "", maximum=MAX_VERSION)  # a client's bound (2**64 restored,
    num = _int(manifest, "num_servers", "", minimum=1, maximum=MAX_SERVERS)  # then every
    # Status ended INTERNAL); a placement's (2**32 - 1 made a listing of every job fail, and a
    # Restore loop over 4 billion slices)
    if not _finite(_field(manifest, "created_unix", (int, float), "")):
        raise ManifestError(f"created_unix must be finite, got {manifest['created_unix']!r}")
    for name, info in _field(manifest, "buffers", dict, "").items():
        _check_buffer(name, info)
    if "model_config" in manifest:  # what a restore gives the job back (size bound included)
        try:
            check_model_config(recorded_model_config(manifest))
        except (ValueError, RecursionError) as exc:
            raise ManifestError(str(exc)) from None
    shards = _field(manifest, "shards", list, "")
    for i, shard in enumerate(shards):
        at = f"shards[{i}]."
        if not isinstance(shard, dict):
            raise ManifestError(f"shards[{i}] must be an object, got {shard!r}")
        _field(shard, "file", str, at)
        _int(shard, "bytes", at)
        sha = _field(shard, "sha256", str, at)
        if not _SHA256.fullmatch(sha):
            raise ManifestError(f"{at}sha256 must be 64 lower-case hex digits, got {sha!r}")
    if strict:
        if len(shards) != num:
            raise ManifestError(f"shards must list num_servers = {num} shards, got {len(shards)}")
        for i, shard in enumerate(shards):
            at = f"shards[{i}]."
            if _int(shard, "server", at) != i:
                raise ManifestError(f"{at}server must be {i} (shards in slice order)")
            if Path(shard["file"]).name != shard_name(i, num):
                raise ManifestError(
                    f"{at}file must name {shard_name(i, num)}, got {shard['file']!r}"
                )
    names = sorted(Path(s["file"]).name for s in shards)
    if names != sorted(shard_name(i, num) for i in range(num)):
        # a Restore reads a slice's shard by its name and checks only the listed ones: one
        # left out was restored unchecked, and one listed 1,000 times was hashed 1,000 times
        raise ManifestError(
            f"shards must list each of the num_servers = {num} shards once"
            f" ({shard_name(0, num)}, ...), got {len(shards)} entries"
        )
    return manifest
