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
import errno
import hashlib
import json
import logging
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

from paramshard.protos import codec, slicing
from paramshard.protos.atomic import fsync_dir
from paramshard.protos.manifest import shard_name
from paramshard.server.runtime.errors import ShardError
from paramshard.server.snapshots.manifest_schema import ManifestError, check_manifest

__all__ = ["Captured", "SnapshotDir", "Reservation", "encode_shard", "decode_shard"]
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,255}")  # a folder name: at most NAME_MAX (255) bytes
log = logging.getLogger("paramshard.snapshots")


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
        raise ShardError.invalid(
            f"{what} {name[:80]!r}{'...' if len(name) > 80 else ''} must be 1 to 255 letters,"
            " digits, '_', '.' or '-'"
        )
    return name


def _exclusive_write(path: Path, data: bytes) -> None:
    """Creates ``path`` with ``data`` whole or not at all, never replacing a file already
    there (FileExistsError): written to a temporary name, fsynced, then hard-linked to its
    name, which fails if the name exists, even when servers share the folder over NFS."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # FileExistsError (errno EEXIST) goes to the caller
        except OSError as exc:  # a filesystem without hard links: exclusive create instead
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            with open(path, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    finally:
        os.unlink(tmp)
    fsync_dir(path.parent)


class Reservation:
    """Shard ``index`` of snapshot ``job/tag``, taken by one Snapshot call until it ends (a
    ``.shard-I-of-N.reserved`` file made with O_EXCL: servers sharing the folder see it)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def release(self) -> None:
        try:
            self.marker.unlink()
        except FileNotFoundError:
            pass


def _key(buffer: str, kind: str) -> str:
    return f"{buffer}::{kind}"


class SnapshotDir:
    """The snapshot directory of one server (None: snapshots are disabled)."""

    def __init__(self, root: str | os.PathLike | None) -> None:
        self.root = Path(root) if root else None
        self.invalid: dict[tuple[str, int], str] = {}  # (manifest path, mtime) -> why skipped

    def _require(self) -> Path:
        if self.root is None:
            raise ShardError.precondition(
                "this server has no snapshot directory: start it with --snapshot-dir DIR"
            )
        return self.root

    def path(self, job: str, tag: str) -> Path:
        return self._require() / _checked(job, "job") / _checked(tag, "snapshot tag")

    # -- writing ------------------------------------------------------------------------------
    def _exists(self, job: str, what: str) -> ShardError:
        return ShardError(
            grpc.StatusCode.ALREADY_EXISTS,
            f"snapshot '{job}/{what}' exists already; a snapshot is written once: pick another tag",
        )

    def reserve(self, job: str, tag: str, index: int, num: int, version: int) -> Reservation:
        """Takes shard ``index`` of ``job/tag`` for one Snapshot call at ``version``:
        ALREADY_EXISTS when the snapshot is committed, the shard written at that version, or
        another call is writing it. A shard of another version with no manifest yet is what an
        earlier attempt left when another server had stepped past its version (the client then
        tries the next version: client/checkpoints.py): it is replaced."""
        folder = self.path(job, tag)
        if (folder / "manifest.json").exists():  # never add to a committed snapshot
            raise self._exists(job, tag)
        folder.mkdir(parents=True, exist_ok=True)
        name = shard_name(index, num)
        marker = folder / f".{name}.reserved"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            raise ShardError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"snapshot '{job}/{tag}': {name} is being written by another Snapshot call",
            ) from None
        shard = folder / name
        if shard.exists() and _shard_version(shard) not in (None, version):
            shard.unlink(missing_ok=True)  # ours alone while the marker is: an abandoned attempt
        if shard.exists() or (folder / "manifest.json").exists():
            marker.unlink()
            raise self._exists(job, f"{tag}/{name}")
        return Reservation(marker)

    def write_shard(
        self, job: str, tag: str, index: int, num: int, version: int, captured: list[Captured]
    ) -> tuple[str, int, str]:
        """Writes this server's shard (never over one already there); returns (relative path,
        bytes, sha256)."""
        folder = self.path(job, tag)
        if (folder / "manifest.json").exists():  # never overwrite a committed snapshot
            raise self._exists(job, tag)
        folder.mkdir(parents=True, exist_ok=True)
        data = encode_shard(job, tag, index, num, version, captured)
        name = shard_name(index, num)
        try:
            _exclusive_write(folder / name, data)
        except FileExistsError:
            raise self._exists(job, f"{tag}/{name}") from None
        return f"{job}/{tag}/{name}", len(data), hashlib.sha256(data).hexdigest()

    def commit(self, job: str, tag: str, manifest_json: str) -> str:
        """Writes the manifest of ``job/tag`` once. Every server of the job commits the same
        manifest (the folder may be shared): the same bytes again succeed, others get
        ALREADY_EXISTS."""
        where = f"snapshot '{job}/{tag}'"
        folder = self.path(job, tag)
        try:
            manifest = check_manifest(json.loads(manifest_json), job, tag, strict=True)
        except (ValueError, RecursionError) as exc:  # not JSON, too deep, or ManifestError
            raise ShardError.invalid(f"{where}: invalid manifest: {exc}") from None
        if not folder.is_dir():
            raise ShardError.not_found(f"{where} has no shard files here")
        path = folder / "manifest.json"
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        try:
            _exclusive_write(path, data)
        except FileExistsError:
            try:
                same = path.read_bytes() == data
            except OSError:
                same = False
            if not same:
                raise ShardError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"{where} is committed already with another manifest; a committed snapshot"
                    " never changes: pick another tag",
                ) from None
        return str(path)

    # -- reading ------------------------------------------------------------------------------
    def list(self, job: str = "") -> list[dict[str, Any]]:
        """Complete snapshots (a valid manifest and every shard named in it), oldest first. A
        manifest that is not valid is skipped and logged, never an error for the listing."""
        root = self._require()
        jobs = (
            [_checked(job, "job")] if job else sorted(p.name for p in root.iterdir() if p.is_dir())
        )
        found = []
        for j in jobs:
            jdir = root / j
            if not jdir.is_dir():
                continue
            for tdir in sorted(jdir.iterdir()):
                path = tdir / "manifest.json"
                try:
                    manifest = check_manifest(json.loads(path.read_text()), j, tdir.name)
                except OSError:
                    continue  # no manifest: not (yet) a snapshot
                except (ValueError, RecursionError) as exc:  # not JSON, or ManifestError
                    self._report(path, exc)
                    continue
                if all((tdir / Path(s["file"]).name).is_file() for s in manifest["shards"]):
                    found.append({**manifest, "tag": tdir.name})  # restored by its folder
        return sorted(found, key=lambda m: (m["version"], m["created_unix"]))

    def _report(self, path: Path, exc: Exception) -> None:
        """Logs an invalid manifest once (again when the file changes)."""
        try:
            key = (str(path), path.stat().st_mtime_ns)
        except OSError:
            return
        if key not in self.invalid:
            self.invalid[key] = str(exc)
            log.warning("skipping snapshot %s: invalid manifest: %s", path, exc)

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
        except (OSError, ValueError, RecursionError) as exc:
            raise ShardError.precondition(
                f"snapshot '{job}/{tag}': {path} is corrupt ({exc})"
            ) from None
        try:
            check_manifest(manifest, job, tag)
        except ManifestError as exc:
            raise ShardError.precondition(
                f"{path} is not a valid manifest of snapshot '{job}/{tag}': {exc}"
            ) from None
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
                if not isinstance(meta, dict):
                    raise ValueError("its metadata is not an object")
            except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
                raise ShardError.precondition(f"{file}: not a paramshard shard ({exc})") from None
            if meta.get("version") != manifest["version"]:
                raise ShardError.precondition(
                    f"{file} holds version {meta.get('version')}, the manifest says"
                    f" {manifest['version']}: it belongs to another snapshot"
                )
            try:
                for name, info in meta["buffers"].items():
                    row = out.setdefault(name, {"state": set(), "step_count": 0})
                    row["state"] |= {str(k) for k in info["state"]}
                    row["step_count"] = max(row["step_count"], int(info["step_count"]))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ShardError.precondition(f"{file}: malformed shard layout ({exc!r})") from None
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
        dtype = np.dtype(codec.master_dtype(info.get("master_dtype")))
        out = np.zeros(stop - start, dtype=dtype)
        for piece in slicing.pieces(numel, old, start, stop):
            file = folder / shard_name(piece.server, old)
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


_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own bound on a header


def _shard_version(path: Path) -> int | None:
    """The version a shard file holds (its header only), None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")  # safetensors: the header's length
            header = json.loads(f.read(min(size, _MAX_HEADER_BYTES)))
        version = json.loads(header["__metadata__"]["paramshard"])["version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return version if isinstance(version, int) else None


def decode_shard(data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata, tensors) of ``encode_shard`` bytes."""
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["paramshard"])
    except Exception as exc:  # safetensors raises its own error types
        raise ShardError.invalid(f"not a paramshard shard ({exc})") from None
    return meta, tensors
