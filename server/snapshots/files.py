"""Snapshots on disk: ``<root>/<job>/<tag>/shard-<i>-of-<N>.safetensors`` + ``manifest.json``.

Writing (docs/design.md §5.1): every buffer of the job is captured in memory at exactly one
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

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from safetensors import SafetensorError, safe_open

from paramshard.protos import codec, slicing
from paramshard.protos.manifest import shard_name, taken_order
from paramshard.server.runtime.errors import ShardError, reason
from paramshard.server.runtime.request_bounds import count_of
from paramshard.server.snapshots.deletion import Removed, remove_tag, torn_tags
from paramshard.server.snapshots.folders import Folder, open_root
from paramshard.server.snapshots.manifest_schema import ManifestError, check_manifest
from paramshard.server.snapshots.reservations import Reservation, take
from paramshard.server.snapshots.shards import (
    Captured,
    array_bytes,
    check_held,
    check_shards_here,
    shard_files,
    shard_meta,
    shard_parts,
    shard_version,
    st_dtype,
    tensor_key,
)

__all__ = ["SnapshotDir"]

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,255}")  # a folder name: at most NAME_MAX (255) bytes
MAX_MANIFEST_BYTES = 64 * 2**20  # committed or read (a 53M-parameter GPT's took 5.9 kB)
log = logging.getLogger("paramshard.snapshots")


def _checked(name: str, what: str) -> str:
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise ShardError.invalid(
            f"{what} {name[:80]!r}{'...' if len(name) > 80 else ''} must be 1 to 255 letters,"
            " digits, '_', '.' or '-'"
        )
    return name


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

    def _folder(self, job: str, tag: str, create: bool = False, missing: str = "") -> Folder:
        """The folder of snapshot ``job/tag``, opened without following a link (folders.py);
        made with ``create``, else NOT_FOUND (``missing`` says why) when it is not there."""
        root, job, tag = self._require(), _checked(job, "job"), _checked(tag, "snapshot tag")
        if create and tag == "latest":  # Restore reads it as the newest: one never restores
            raise ShardError.invalid(
                "snapshot: the tag 'latest' means the newest snapshot when restoring; choose"
                " another tag"
            )
        try:
            with open_root(root, create) as top, top.child(job, create) as folder:
                return folder.child(tag, create)
        except FileNotFoundError:
            why = missing or f"{root / job / tag / 'manifest.json'} is missing"
            raise ShardError.not_found(f"snapshot '{job}/{tag}': {why}") from None

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
        folder = self._folder(job, tag, create=True)
        reservation = None
        try:
            if folder.kind("manifest.json") is not None:  # never add to a committed snapshot
                raise self._exists(job, tag)
            name = shard_name(index, num)
            reservation = take(folder, name, f"snapshot '{job}/{tag}'")
            # (no link is read; version 0 is a version: ``held`` is None only for no shard)
            held = shard_version(folder, name) if folder.kind(name) == "file" else None
            if held is not None and held != version:
                folder.unlink(name)  # ours alone while the marker is: an abandoned attempt
            if held == version and folder.kind("manifest.json") is None:
                # kept: another call of this snapshot may commit it (its manifest names it)
                raise ShardError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"snapshot '{job}/{tag}': shard {name} was written at version {version}"
                    " by an earlier attempt that was not committed (a server failed during"
                    " it?, or one is still under way); a tag is written once: pick another tag",
                )
            if folder.kind(name) is not None or folder.kind("manifest.json") is not None:
                raise self._exists(job, f"{tag}/{name}")
        except BaseException:
            if reservation is not None:  # its marker and its place among the live holds
                reservation.release()
            folder.close()
            raise
        return reservation

    def write_shard(
        self, job: str, tag: str, index: int, num: int, version: int, captured: list[Captured]
    ) -> tuple[str, int, str]:
        """Writes this server's shard (never over one already there); returns (relative path,
        bytes, sha256)."""
        head, arrays = shard_parts(job, tag, index, num, version, captured)
        data = [head, *map(array_bytes, arrays)]  # written as they are, not joined first
        digest = hashlib.sha256()
        for part in data:
            digest.update(part)
        name = shard_name(index, num)
        with self._folder(job, tag, create=True) as folder:
            if folder.kind("manifest.json") is not None:  # never overwrite a committed snapshot
                raise self._exists(job, tag)
            try:
                folder.write_once(name, data)
            except FileExistsError:
                raise self._exists(job, f"{tag}/{name}") from None
        return f"{job}/{tag}/{name}", sum(map(len, data)), digest.hexdigest()

    def commit(self, job: str, tag: str, manifest_json: str) -> str:
        """Writes the manifest of ``job/tag`` once. Every server of the job commits the same
        manifest (the folder may be shared): the same bytes again succeed, others get
        ALREADY_EXISTS. Every shard the manifest names must be here first, at its size: a
        server whose folder is not the others' commits nothing (the snapshot could not be
        restored from it)."""
        where = f"snapshot '{job}/{tag}'"
        self.path(job, tag)  # the names, before the manifest
        try:
            manifest = check_manifest(json.loads(manifest_json), job, tag, strict=True)
        except (ValueError, RecursionError) as exc:  # not JSON, too deep, or ManifestError
            raise ShardError.invalid(f"{where}: invalid manifest: {exc}") from None
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        if len(data) > MAX_MANIFEST_BYTES:  # it could not be read back
            raise ShardError.invalid(
                f"{where}: the manifest takes {len(data):,} bytes, more than {MAX_MANIFEST_BYTES:,}"
            )
        with self._folder(job, tag, missing="no shard files here") as folder:
            if folder.kind("manifest.json") is None:  # committed already: answered below
                check_shards_here(folder, manifest, where)
            try:
                folder.write_once("manifest.json", data)
            except FileExistsError:
                try:
                    same = folder.read("manifest.json", MAX_MANIFEST_BYTES) == data
                except FileNotFoundError:  # there a moment ago
                    raise ShardError.precondition(
                        f"{where} was deleted while it was committed (DeleteSnapshot)"
                    ) from None
                except (OSError, ShardError, ValueError):  # ValueError: past the bound
                    same = False
                if not same:
                    raise ShardError(
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"{where} is committed already with another manifest; a committed"
                        " snapshot never changes: pick another tag",
                    ) from None
            return folder.name("manifest.json")

    def delete(self, job: str, tag: str, check_only: bool = False) -> Removed:
        """Removes snapshot ``job/tag`` from this folder (deletion.py)."""
        if tag == "latest":  # no folder has that name (``_folder``): it would delete nothing
            raise ShardError.invalid(
                "delete: name the snapshot's tag; 'latest' is resolved only when restoring"
            )
        self.path(job, tag)  # the names, and that there is a directory
        return remove_tag(self._require(), job, tag, f"snapshot '{job}/{tag}'", check_only)

    # -- reading ------------------------------------------------------------------------------
    def list(self, job: str = "", torn: bool = False) -> list[dict[str, Any]]:
        """Complete snapshots (a valid manifest and every shard named in it), oldest first;
        with ``torn``, then the torn tags (deletion.py). A manifest that is not valid, or a
        folder or file that is a link, is skipped and logged, never an error for the listing."""
        root = self._require()
        found, torn_rows = [], []
        try:
            top = open_root(root)
        except FileNotFoundError:
            return []
        with top:
            if job:
                jobs = [_checked(job, "job")]
            else:
                jobs = [name for name, kind in top.entries() if kind == "folder"]
            for j in jobs:
                try:
                    jdir = top.child(j)
                except FileNotFoundError:
                    continue
                with jdir:
                    for tag, kind in jdir.entries():
                        manifest = self._listed(jdir, j, tag, kind)
                        if manifest is not None:
                            found.append({**manifest, "tag": tag})  # restored by its folder
                    torn_rows += torn_tags(jdir, j) if torn else []
        return sorted(found, key=taken_order) + torn_rows

    def _listed(self, jdir: Folder, job: str, tag: str, kind: str) -> dict[str, Any] | None:
        """The manifest of folder ``tag`` of ``jdir`` when it is a complete snapshot."""
        if kind == "link":
            self._report(jdir.name(tag), 0, "a symbolic link: not followed")
        if kind != "folder":
            return None
        try:
            tdir = jdir.child(tag)
        except FileNotFoundError:  # deleted since the folder was listed (DeleteSnapshot)
            return None
        except ShardError as exc:  # a link planted in the folder (folders.py)
            self._report(jdir.name(tag), 0, exc.message)
            return None
        try:
            with tdir:
                try:
                    manifest = check_manifest(
                        json.loads(tdir.read("manifest.json", MAX_MANIFEST_BYTES)), job, tag
                    )
                except OSError:
                    return None  # no manifest: not (yet) a snapshot
                except (ValueError, RecursionError) as exc:  # not JSON, or ManifestError
                    self._report(tdir.name("manifest.json"), tdir.mtime_ns("manifest.json"), exc)
                    return None
                if all(tdir.kind(Path(s["file"]).name) == "file" for s in manifest["shards"]):
                    return manifest
        except ShardError as exc:  # a link planted in the folder (folders.py)
            self._report(jdir.name(tag), 0, exc.message)
        except OSError:  # its files deleted while it was read
            pass
        return None

    def _report(self, shown: str, mtime_ns: int, why: object) -> None:
        """Logs a snapshot skipped by the listing once (again when the file changes)."""
        key = (shown, mtime_ns)
        if key not in self.invalid:
            self.invalid[key] = str(why)
            log.warning("skipping snapshot %s: %s", shown, why)

    def latest(self, job: str) -> str:
        complete = self.list(job)
        if not complete:
            raise ShardError.not_found(f"job '{job}' has no complete snapshot in {self.root}")
        return complete[-1]["tag"]

    def load_manifest(self, job: str, tag: str) -> dict[str, Any]:
        """The manifest, after checking that every shard is there and matches its checksum."""
        with self._folder(job, tag) as folder:
            path = folder.name("manifest.json")
            try:
                manifest = json.loads(folder.read("manifest.json", MAX_MANIFEST_BYTES))
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
                name = Path(shard["file"]).name
                try:
                    size, sha256 = _digest(folder, name, shard["bytes"])
                except OSError:
                    raise ShardError.not_found(
                        f"snapshot '{job}/{tag}': {folder.name(name)} is missing"
                    ) from None
                if size != shard["bytes"] or sha256 != shard["sha256"]:
                    raise ShardError.precondition(
                        f"snapshot '{job}/{tag}': {folder.name(name)} does not match its checksum"
                        f" in the manifest ({size:,} bytes, manifest says"
                        f" {shard['bytes']:,}): truncated or corrupt"
                    )
        return manifest

    def layout(self, job: str, tag: str, manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Per buffer: the optimizer-state arrays and step count the shards recorded."""
        out: dict[str, dict[str, Any]] = {}
        with self._folder(job, tag) as folder:
            metas = [(folder.name(n), shard_meta(folder, n)) for n in shard_files(manifest)]
        for file, meta in metas:
            if meta.get("version") != manifest["version"]:
                raise ShardError.precondition(
                    f"{file} holds version {meta.get('version')}, the manifest says"
                    f" {manifest['version']}: it belongs to another snapshot"
                )
            try:
                for name, info in meta["buffers"].items():
                    row = out.setdefault(name, {"state": set(), "step_count": 0})
                    row["state"] |= {str(k) for k in info["state"]}
                    count = count_of(info["step_count"], f"buffer '{name}': step_count")
                    row["step_count"] = max(row["step_count"], count)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                why = reason(exc)
                raise ShardError.precondition(f"{file}: malformed shard layout ({why})") from None
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
        info = manifest["buffers"][buffer]
        numel = info["numel"]
        old = manifest["num_servers"]
        dtype = np.dtype(codec.master_dtype(info.get("master_dtype")))
        want = st_dtype(dtype)
        out = np.zeros(stop - start, dtype=dtype)
        with self._folder(job, tag) as folder:
            for piece in slicing.pieces(numel, old, start, stop):
                name = shard_name(piece.server, old)
                try:
                    with folder.path_of(name) as path, safe_open(path, framework="numpy") as f:
                        key = tensor_key(buffer, kind)
                        if key not in f.keys():
                            if kind == "params":  # a buffer the manifest made up
                                raise ValueError("the shard holds no such tensor")
                            continue  # optimizer state not allocated yet at that version
                        held = f.get_slice(key)
                        check_held(held.get_shape(), numel, old, piece.server)
                        if (kept := held.get_dtype()) != want:  # was cast: 1e300 to inf
                            raise ValueError(f"it holds {kept}, the buffer's is {want}")
                        lo = piece.local_offset
                        a = piece.global_offset - start
                        for b in range(0, piece.numel, _READ_ELEMENTS):  # a piece whole took
                            n = min(_READ_ELEMENTS, piece.numel - b)  # one more copy of it
                            out[a + b : a + b + n] = held[lo + b : lo + b + n]
                except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
                    raise ShardError.precondition(
                        f"{folder.name(name)}: cannot read {buffer} {kind} ({exc})"
                    ) from None
        return out


_READ_BLOCK = 8 * 2**20
_READ_ELEMENTS = 2**21  # of a shard's tensor at a time (``read_range``): each read is a new
# array, and a piece read whole one more copy (an offline export held 2.06x its largest tensor)


def _digest(folder: Folder, name: str, expected: int) -> tuple[int, str]:
    """(size, sha256) of file ``name``, read a block at a time (read whole: 1.6 GB resident
    restoring GPT-2 124M, security.md 121); (its size, "") unread when not ``expected`` (a
    planted sparse shard of 1 TiB was hashed for half an hour, 143)."""
    digest, size, block = hashlib.sha256(), 0, bytearray(_READ_BLOCK)
    with os.fdopen(folder.open(name), "rb", buffering=0) as f:
        if (found := os.fstat(f.fileno()).st_size) != expected:
            return found, ""
        while n := f.readinto(block):
            digest.update(memoryview(block)[:n])
            size += n
    return size, digest.hexdigest()
