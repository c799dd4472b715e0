"""Snapshots on disk: ``<root>/<job>/<tag>/shard-<i>-of-<N>.safetensors`` + ``manifest.json``.

Writing (DESIGN section 5): every buffer of the job is captured in memory at exactly one
version (training goes on), then the shard file is written to a temporary name, fsynced and
renamed. The client commits the snapshot by sending the manifest (layout, versions, optimizer
hyper-parameters, each shard's sha256), written the same way; a snapshot counts only when the
manifest and every shard it names are there.

Reading for restore: each server cuts its new slice of every buffer (any number of servers)
and reads just those ranges of params and optimizer state from the old shards, after checking
every shard's checksum. Any missing, truncated, corrupt or mismatched file is an error that
names the file, and nothing is loaded.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from protos import slicing
from protos.manifest import FORMAT
from server.errors import ShardError

__all__ = ["Captured", "SnapshotDir", "encode_shard", "decode_shard"]
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class Captured:
    """One buffer slice as it was at the snapshot's version (host copies)."""

    buffer: str
    slice_start: int
    params: np.ndarray
    state: dict[str, np.ndarray]
    step_count: int


def _checked(name: str, what: str) -> str:
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise ShardError.invalid(f"{what} {name!r} must be letters, digits, '_', '.' or '-'")
    return name


def _atomic_write(path: Path, data: bytes) -> None:
    """Temporary file in the same directory, fsync, rename, fsync the directory."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def _key(buffer: str, kind: str) -> str:
    return f"{buffer}::{kind}"


class SnapshotDir:
    """The snapshot directory of one server (None: snapshots are disabled)."""

    def __init__(self, root: str | os.PathLike | None) -> None:
        self.root = Path(root) if root else None

    def _require(self) -> Path:
        if self.root is None:
            raise ShardError.precondition(
                "this server has no snapshot directory: start it with --snapshot-dir DIR"
            )
        return self.root

    def path(self, job: str, tag: str) -> Path:
        return self._require() / _checked(job, "job") / _checked(tag, "snapshot tag")

    # -- writing ------------------------------------------------------------------------------
    def write_shard(
        self, job: str, tag: str, index: int, num: int, version: int, captured: list[Captured]
    ) -> tuple[str, int, str]:
        """Writes this server's shard; returns (relative path, bytes, sha256)."""
        folder = self.path(job, tag)
        if (folder / "manifest.json").exists():  # never overwrite a committed snapshot
            raise ShardError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"snapshot '{job}/{tag}' exists already; pick another tag",
            )
        folder.mkdir(parents=True, exist_ok=True)
        data = encode_shard(job, tag, index, num, version, captured)
        name = f"shard-{index}-of-{num}.safetensors"
        _atomic_write(folder / name, data)
        return f"{job}/{tag}/{name}", len(data), hashlib.sha256(data).hexdigest()

    def commit(self, job: str, tag: str, manifest_json: str) -> str:
        try:
            manifest = json.loads(manifest_json)
        except ValueError as exc:
            raise ShardError.invalid(
                f"snapshot '{job}/{tag}': manifest is not JSON ({exc})"
            ) from None
        if manifest.get("format") != FORMAT:
            raise ShardError.invalid(f"snapshot '{job}/{tag}': manifest format is not {FORMAT}")
        folder = self.path(job, tag)
        if not folder.is_dir():
            raise ShardError.not_found(f"snapshot '{job}/{tag}' has no shard files here")
        path = folder / "manifest.json"
        _atomic_write(path, json.dumps(manifest, indent=1, sort_keys=True).encode())
        return str(path)

    # -- reading ------------------------------------------------------------------------------
    def list(self, job: str = "") -> list[dict[str, Any]]:
        """Complete snapshots (manifest present and every shard named in it), oldest first."""
        root = self._require()
        jobs = (
            [_checked(job, "job")] if job else sorted(p.name for p in root.iterdir() if p.is_dir())
        )
        found = []
        for j in jobs:
            jdir = root / j
            if not jdir.is_dir():
                continue
            for tdir in jdir.iterdir():
                try:
                    manifest = json.loads((tdir / "manifest.json").read_text())
                    complete = manifest.get("format") == FORMAT and all(
                        (tdir / Path(s["file"]).name).is_file() for s in manifest["shards"]
                    )
                except (OSError, ValueError, AttributeError, KeyError, TypeError):
                    continue  # not a manifest of ours: not a snapshot
                if complete:
                    found.append(manifest)
        return sorted(found, key=lambda m: (m["version"], m["created_unix"]))

    def latest(self, job: str) -> str:
        complete = self.list(job)
        if not complete:
            raise ShardError.not_found(f"job '{job}' has no complete snapshot in {self.root}")
        return complete[-1]["tag"]

    def load_manifest(self, job: str, tag: str) -> dict[str, Any]:
        """The manifest, after checking that every shard is there and matches its checksum."""
        folder = self.path(job, tag)
        path = folder / "manifest.json"
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise ShardError.not_found(f"snapshot '{job}/{tag}': {path} is missing") from None
        except (OSError, ValueError) as exc:
            raise ShardError.precondition(
                f"snapshot '{job}/{tag}': {path} is corrupt ({exc})"
            ) from None
        if (
            not isinstance(manifest, dict)
            or manifest.get("format") != FORMAT
            or manifest.get("job") != job
            or not isinstance(manifest.get("shards"), list)
            or not isinstance(manifest.get("buffers"), dict)
        ):
            raise ShardError.precondition(f"{path} is not a {FORMAT} manifest of job '{job}'")
        for shard in manifest["shards"]:
            file = folder / Path(shard["file"]).name
            try:
                data = file.read_bytes()
            except OSError:
                raise ShardError.not_found(f"snapshot '{job}/{tag}': {file} is missing") from None
            if len(data) != shard["bytes"] or hashlib.sha256(data).hexdigest() != shard["sha256"]:
                raise ShardError.precondition(
                    f"snapshot '{job}/{tag}': {file} does not match its checksum in the manifest"
                    f" ({len(data):,} bytes, manifest says {shard['bytes']:,}): truncated or"
                    " corrupt"
                )
        return manifest

    def layout(self, job: str, tag: str, manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Per buffer: the optimizer-state arrays and step count the shards recorded."""
        folder = self.path(job, tag)
        out: dict[str, dict[str, Any]] = {}
        for shard in manifest["shards"]:
            file = folder / Path(shard["file"]).name
            try:
                with safe_open(str(file), framework="numpy") as f:
                    meta = json.loads(f.metadata()["paramshard"])
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                raise ShardError.precondition(f"{file}: not a paramshard shard ({exc})") from None
            if meta.get("version") != manifest["version"]:
                raise ShardError.precondition(
                    f"{file} holds version {meta.get('version')}, the manifest says"
                    f" {manifest['version']}: it belongs to another snapshot"
                )
            for name, info in meta["buffers"].items():
                row = out.setdefault(name, {"state": set(), "step_count": 0})
                row["state"] |= set(info["state"])
                row["step_count"] = max(row["step_count"], info["step_count"])
        return out

    def read_range(
        self,
        job: str,
        tag: str,
        manifest: dict[str, Any],
        buffer: str,
        kind: str,
        start: int,
        stop: int,
    ) -> np.ndarray:
        """Elements [start, stop) of a buffer's params (kind "params") or optimizer state
        ("state.<name>"), gathered from the old shards holding them, in the buffer's master
        dtype (the manifest's ``master_dtype``; float32 for snapshots that predate it)."""
        folder = self.path(job, tag)
        info = manifest["buffers"][buffer]
        numel = info["numel"]
        old = manifest["num_servers"]
        dtype = np.float64 if info.get("master_dtype") == "float64" else np.float32
        out = np.zeros(stop - start, dtype=dtype)
        for piece in slicing.pieces(numel, old, start, stop):
            file = folder / f"shard-{piece.server}-of-{old}.safetensors"
            try:
                with safe_open(str(file), framework="numpy") as f:
                    key = _key(buffer, kind)
                    if key not in f.keys():
                        continue  # optimizer state not allocated yet at that version
                    part = f.get_slice(key)[piece.local_offset : piece.local_offset + piece.numel]
            except (OSError, ValueError, RuntimeError) as exc:
                raise ShardError.precondition(
                    f"{file}: cannot read {buffer} {kind} ({exc})"
                ) from None
            a = piece.global_offset - start
            out[a : a + piece.numel] = part
        return out


def encode_shard(
    job: str,
    tag: str,
    index: int,
    num: int,
    version: int,
    captured: list[Captured],
    specs: dict[str, bytes] | None = None,
) -> bytes:
    """One server's slices as safetensors bytes: ``<buffer>::params`` and
    ``<buffer>::state.<name>`` tensors, layout in the ``paramshard`` metadata. ``specs``
    (buffer -> serialised RegisterBufferRequest) makes the shard loadable on its own, as a
    neighbour replica is (a snapshot's manifest holds that instead)."""
    tensors: dict[str, np.ndarray] = {}
    layout = {}
    for c in captured:
        tensors[_key(c.buffer, "params")] = c.params
        for name, arr in c.state.items():
            tensors[_key(c.buffer, f"state.{name}")] = arr
        layout[c.buffer] = {
            "slice_start": c.slice_start,
            "slice_numel": int(c.params.size),
            "step_count": c.step_count,
            "state": sorted(c.state),
        }
        if specs is not None:
            layout[c.buffer]["spec"] = base64.b64encode(specs[c.buffer]).decode()
    meta = {
        "job": job,
        "tag": tag,
        "version": version,
        "server_index": index,
        "num_servers": num,
        "buffers": layout,
    }
    return st_save(tensors, metadata={"paramshard": json.dumps(meta)})


def decode_shard(data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata, tensors) of ``encode_shard`` bytes."""
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["paramshard"])
    except Exception as exc:  # safetensors raises its own error types
        raise ShardError.invalid(f"not a paramshard shard ({exc})") from None
    return meta, tensors
