"""``paramshard inspect · get · snapshot · snapshots · restore · export``: the job tools.

Each command is a thin shell over a function of ``client.tools`` (offline export reads the
snapshot files directly, as a server restoring them does). Every command takes ``--servers``
(default: $PARAMSHARD_SERVERS) and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from paramshard.cli import EXIT_USAGE, CommandError, _cluster_spec, _table, arg, command

SERVERS = arg("--servers", metavar="HOST:PORT,...", help="servers (default: $PARAMSHARD_SERVERS)")
JSON = arg("--json", action="store_true", help="print JSON instead of a table")


def _client(args: argparse.Namespace) -> Any:
    from client import ShardClient

    return ShardClient(_cluster_spec(args.servers), timeout_s=args.timeout, retries=2)


TIMEOUT = arg("--timeout", type=float, default=120.0, help="deadline per call, s (default 120)")


def _run(fn: Any, *a: Any) -> Any:
    """Runs a tool function, turning its errors into one-line command errors."""
    from client import ShardClientError

    try:
        return fn(*a)
    except (KeyError, ShardClientError, RuntimeError) as exc:
        raise CommandError(str(exc).strip("'\"")) from None


@command(arg("job", help="the job name (see paramshard status)"), SERVERS, JSON, TIMEOUT)
def inspect(args: argparse.Namespace) -> int:
    """One row per parameter: name, shape, dtype, servers holding it, version, norm, min, max,
    all finite."""
    from client import tools

    rows = _run(tools.inspect, _client(args), args.job)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = [
        [
            r["name"],
            "x".join(map(str, r["shape"])) or "()",
            r["dtype"],
            ",".join(map(str, r["servers"])),
            str(r["version"]),
            f"{r['norm']:.6g}",
            f"{r['min']:.4g}",
            f"{r['max']:.4g}",
            "yes" if r["finite"] else "NO",
        ]
        for r in rows
    ]
    print(
        _table(
            ["NAME", "SHAPE", "DTYPE", "SERVERS", "VERSION", "NORM", "MIN", "MAX", "FINITE"],
            table,
            frozenset({4, 5, 6, 7}),
        )
    )
    return 0


@command(
    arg("job"),
    arg("param", help="the parameter's name in the model"),
    arg("--out", required=True, help="file to write: .npy or .safetensors"),
    SERVERS,
    TIMEOUT,
)
def get(args: argparse.Namespace) -> int:
    """Gather one full parameter from the servers holding its pieces."""
    import numpy as np

    from client import tools

    values = _run(tools.get_param, _client(args), args.job, args.param)
    if args.out.endswith(".safetensors"):
        from safetensors.numpy import save_file

        save_file({args.param: np.ascontiguousarray(values)}, args.out)
    elif args.out.endswith(".npy"):
        np.save(args.out, values)
    else:
        raise CommandError("--out must end in .npy or .safetensors", EXIT_USAGE)
    print(f"{args.param}: {list(values.shape)} -> {args.out}")
    return 0


@command(
    arg("job"), arg("--tag", required=True, help="the snapshot's name"), SERVERS, JSON, TIMEOUT
)
def snapshot(args: argparse.Namespace) -> int:
    """Snapshot a job on one version while it trains; each server writes its shard into its
    --snapshot-dir, then the manifest is committed."""
    from client import tools

    manifest = _run(tools.snapshot, _client(args), args.job, args.tag)
    if args.json:
        print(json.dumps(manifest, indent=1))
    else:
        print(
            f"snapshot {args.job}/{args.tag}: version {manifest['version']},"
            f" {manifest['num_servers']} shards, {len(manifest['buffers'])} buffers"
        )
    return 0


@command(arg("--job", default="", help="only this job"), SERVERS, JSON, TIMEOUT)
def snapshots(args: argparse.Namespace) -> int:
    """The complete snapshots in server 0's snapshot directory."""
    from client import tools

    rows = _run(tools.list_snapshots, _client(args), args.job)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        _table(
            ["JOB", "TAG", "VERSION", "SERVERS"],
            [[r["job"], r["tag"], str(r["version"]), str(r["num_servers"])] for r in rows],
            frozenset({2, 3}),
        )
    )
    return 0


@command(
    arg("job"),
    arg("--tag", default="latest", help="snapshot to load (default: latest)"),
    arg(
        "--contributors",
        type=int,
        default=0,
        help="data-parallel ranks from now on (default: as in the snapshot)",
    ),
    SERVERS,
    TIMEOUT,
)
def restore(args: argparse.Namespace) -> int:
    """Load a snapshot into these servers; their number may differ from the snapshot's."""
    from client import tools

    version = _run(tools.restore, _client(args), args.job, args.tag, args.contributors)
    print(f"restored {args.job}/{args.tag} at version {version}")
    return 0


@command(
    arg("job", nargs="?", help="the job (live export; not with --snapshot)"),
    arg(
        "--snapshot",
        metavar="DIR",
        help="a snapshot folder <snapshot-dir>/<job>/<tag>: export offline, no server needed",
    ),
    arg("--out", required=True, help="the .safetensors file to write"),
    SERVERS,
    TIMEOUT,
)
def export(args: argparse.Namespace) -> int:
    """The full state dict under the model's own names, loadable with
    model.load_state_dict(safetensors.torch.load_file(OUT)); streamed, one parameter at a time."""
    if args.snapshot:
        count = export_snapshot(Path(args.snapshot), args.out)
    elif args.job:
        from client import tools

        count = _run(tools.export, _client(args), args.job, args.out)
    else:
        raise CommandError("give a JOB (live servers) or --snapshot DIR", EXIT_USAGE)
    print(f"{count} tensors -> {args.out}")
    return 0


def export_snapshot(folder: Path, out: str | os.PathLike) -> int:
    """Offline export of a snapshot folder; checks every shard's checksum first."""
    from client.tools import write_safetensors
    from server.errors import ShardError
    from server.snapshots import SnapshotDir

    folder = folder.resolve()
    snaps = SnapshotDir(folder.parent.parent)
    job, tag = folder.parent.name, folder.name
    try:
        manifest = snaps.load_manifest(job, tag)
    except ShardError as exc:
        raise CommandError(exc.message) from None
    items = []
    for buffer, info in manifest["buffers"].items():
        for p in info["params"]:

            def produce(b: str = buffer, p: dict = p) -> Any:
                return snaps.read_range(
                    job, tag, manifest, b, "params", p["offset"], p["offset"] + p["numel"]
                )

            dtype = p["dtype"] if p["dtype"] in ("float32", "float16", "bfloat16") else "float32"
            for name in (p["name"], *p.get("aliases", [])):
                items.append((name, dtype, tuple(p["shape"]), produce))
    try:
        write_safetensors(out, items, {"job": job, "tag": tag, "version": str(manifest["version"])})
    except ShardError as exc:
        raise CommandError(exc.message) from None
    return len(items)
