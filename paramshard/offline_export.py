"""Offline export: a snapshot folder's files into a state-dict file or a Hugging Face folder,
without a server (``paramshard export --snapshot DIR``, paramshard/tools_cli.py). The shards
are read as a server restoring them reads them (server/snapshots/files.py) and every checksum
is checked first; a 3D job's parts are joined through client/tensor_parts.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from paramshard.commands import CommandError

__all__ = ["export_snapshot", "recorded_model"]

Params = list[Any]  # client.tensor_parts.WholeParam


def export_snapshot(
    folder: Path, out: str | os.PathLike | None = None, hf_dir: str | os.PathLike | None = None
) -> int:
    """Offline export of a snapshot folder ``<snapshot-dir>/<job>/<tag>`` into the file
    ``out``, or (``hf_dir``) a Hugging Face model's ``from_pretrained`` folder; checks every
    shard's checksum first. When ``<job>`` is a 3D job's base name (no folder ``<job>``, but
    ``<job>.pp<s>.tp<t>/<tag>``), the whole model, joined from every part's snapshot."""
    from paramshard.client.tensor_parts import find_parts
    from paramshard.server.runtime.errors import ShardError
    from paramshard.server.snapshots.files import SnapshotDir

    folder = folder.resolve()
    snaps = SnapshotDir(folder.parent.parent)
    job, tag = folder.parent.name, folder.name

    def write(params: Params, meta: dict[str, str], manifests: list[dict[str, Any]]) -> int:
        from paramshard.client.export import whole_items, write_safetensors
        from paramshard.client.export_hf import write_hf

        if hf_dir is not None:
            return write_hf(hf_dir, recorded_model(manifests, folder), params, meta)
        items = whole_items(params)
        write_safetensors(out, items, meta)
        return len(items)

    try:
        if not folder.parent.exists() and folder.parent.parent.is_dir():
            parts = find_parts(job, (p.name for p in folder.parent.parent.iterdir() if p.is_dir()))
            if parts:
                return _export_parts(snaps, job, tag, parts, write)
        return _export_plain(snaps, job, tag, write)
    except ShardError as exc:
        raise CommandError(exc.message) from None


def recorded_model(manifests: list[dict[str, Any]], folder: Path) -> dict[str, Any]:
    """The model description a snapshot's manifest (any part's, of a 3D job) recorded."""
    for m in manifests:
        if isinstance(m.get("model_config"), dict):
            return m["model_config"]
    raise CommandError(
        f"{folder}: the snapshot records no model config: only a Hugging Face"
        " PreTrainedModel's job records one when it registers; export it with --out"
    )


def _span(entry: dict[str, Any]) -> tuple[int, int]:
    """A manifest's parameter entry's elements in its buffer, [start, stop), with the
    manifest's defaults as a Restore takes them: no ``offset`` is 0, no ``numel`` none (they
    gave a traceback)."""
    start = entry.get("offset", 0)
    return start, start + entry.get("numel", 0)


def _export_plain(snaps: Any, job: str, tag: str, write: Any) -> int:
    from paramshard.client.tensor_parts import WholeParam
    from paramshard.protos.manifest import ParamEntry

    manifest = snaps.load_manifest(job, tag)
    params: Params = []
    for buffer, info in manifest["buffers"].items():
        for p in info["params"]:

            def produce(b: str = buffer, p: dict = p) -> Any:
                return snaps.read_range(job, tag, manifest, b, "params", *_span(p))

            entry = ParamEntry.from_manifest(p)
            params.append(WholeParam.of(entry, produce=produce, source=(job,)))
    meta = {"job": job, "tag": tag, "version": str(manifest["version"])}
    return write(params, meta, [manifest])


def _export_parts(
    snaps: Any, base: str, tag: str, parts: dict[tuple[int, int], str], write: Any
) -> int:
    """The whole model from the snapshots ``tag`` of a 3D job's parts (each checked first)."""
    from paramshard.client.tensor_parts import PartParam, PartsError, check_complete, join_parts

    root = snaps.root
    with_tag = {k: name for k, name in parts.items() if (root / name / tag).is_dir()}
    if not with_tag:
        raise CommandError(
            f"{root / base / tag} does not exist, and no part of the 3D job '{base}'"
            f" ({', '.join(parts.values())}) has a snapshot '{tag}'"
        )
    what = f"snapshot '{tag}' of job '{base}'"
    try:
        check_complete(base, with_tag, (), what)  # none between the parts found lacks the tag
        manifests = {k: snaps.load_manifest(name, tag) for k, name in with_tag.items()}
        expected = [
            name
            for m in manifests.values()
            if isinstance(m.get("hybrid"), dict) and m["hybrid"].get("base") == base
            for name in m["hybrid"].get("parts", [])
        ]
        versions = {with_tag[k]: m["version"] for k, m in manifests.items()}
        if len(set(versions.values())) != 1:
            raise PartsError(
                f"the parts of snapshot '{base}/{tag}' hold different versions"
                f" ({', '.join(f'{j}: {v}' for j, v in versions.items())})"
            )
        params = {}
        for k, m in manifests.items():
            job = with_tag[k]
            params[k] = [
                PartParam.from_manifest(
                    p,
                    read=lambda job=job, m=m, b=buffer, p=p: snaps.read_range(
                        job, tag, m, b, "params", *_span(p)
                    ),
                )
                for buffer, info in m["buffers"].items()
                for p in info["params"]
            ]
        whole = join_parts(base, params, with_tag, expected, what)
        version = next(iter(versions.values()))
        parts_meta = ",".join(with_tag.values())
        meta = {"job": base, "tag": tag, "version": str(version), "parts": parts_meta}
        return write(whole, meta, list(manifests.values()))
    except (PartsError, KeyError, TypeError) as exc:
        raise CommandError(f"{root}: {str(exc).strip(chr(39))}") from None
