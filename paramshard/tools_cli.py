"""``paramshard inspect · get · snapshot · snapshots · restore · drop · delete-snapshot ·
export``: the job tools.

Each command is a thin shell over a function of ``client.tools`` (offline export reads the
snapshot files directly, as a server restoring them does). Every command takes ``--servers``
(default: $PARAMSHARD_SERVERS, else the run ``paramshard launch`` is running, ``--run`` picking
one of several: paramshard/run_files.py) and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from paramshard.commands import (
    EXIT_USAGE,
    RUN,
    CommandError,
    arg,
    cluster_spec,
    command,
    int_in,
    positive,
    table,
)
from paramshard.offline_export import export_snapshot

SERVERS = arg(
    "--servers",
    metavar="HOST:PORT,...",
    help="servers (default: $PARAMSHARD_SERVERS, else the run paramshard launch is running)",
)
JSON = arg("--json", action="store_true", help="print JSON instead of a table")


def _client(args: argparse.Namespace) -> Any:
    from paramshard.client import ShardClient

    spec = cluster_spec(args.servers, args.run_id)
    return ShardClient(spec, timeout_s=args.timeout, retries=2)


TIMEOUT = arg("--timeout", type=positive, default=120.0, help="deadline per call, s (default 120)")


def _check_out(flag: str, path: str, folder: bool = False) -> None:
    """Refuses an output path that cannot be written before anything is fetched: a file whose
    folder is missing or not writable, or that is a folder; a folder (``folder``, made with
    its missing parents) that is a file, or under a file or a folder not writable. A write
    that fails later still ends in one line."""
    target = Path(path)
    if not folder and target.is_dir():
        raise CommandError(f"{flag} {path}: is a folder; give a file name", EXIT_USAGE)
    if folder and target.exists() and not target.is_dir():
        raise CommandError(f"{flag} {path}: is a file; give a folder", EXIT_USAGE)
    parent = target.absolute().parent
    if folder:
        parent = target.absolute()
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    if not parent.is_dir():
        raise CommandError(f"{flag} {path}: no such folder {str(parent)!r}", EXIT_USAGE)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CommandError(f"{flag} {path}: cannot write into {str(parent)!r}", EXIT_USAGE)


def _run(args: argparse.Namespace, fn: Any, *a: Any) -> Any:
    """Runs a tool function on a client of the servers (closed after it: no grpc object is
    left to the garbage collector at exit), turning its errors into one-line command errors."""
    from paramshard.client import ShardClientError

    client = _client(args)
    try:
        return fn(client, *a)
    except (KeyError, ShardClientError, RuntimeError) as exc:
        # a KeyError's str() is its message quoted: take the message itself
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise CommandError(str(message)) from None
    except OSError as exc:  # writing the output (checked before, changed since)
        raise CommandError(f"{exc.filename}: {exc.strerror or exc}") from None
    finally:
        client.close()


@command(arg("job", help="the job name (see paramshard status)"), SERVERS, RUN, JSON, TIMEOUT)
def inspect(args: argparse.Namespace) -> int:
    """One row per parameter: name, shape, dtype, servers holding it, version, norm, min, max,
    all finite."""
    from paramshard.client import tools

    rows = _run(args, tools.inspect, args.job)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    cells = [
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
        table(
            ["NAME", "SHAPE", "DTYPE", "SERVERS", "VERSION", "NORM", "MIN", "MAX", "FINITE"],
            cells,
            frozenset({4, 5, 6, 7}),
        )
    )
    return 0


@command(
    arg("job"),
    arg("param", help="the parameter's name in the model"),
    arg("--out", required=True, help="file to write: .npy or .safetensors"),
    SERVERS,
    RUN,
    TIMEOUT,
)
def get(args: argparse.Namespace) -> int:
    """Gather one full parameter from the servers holding its pieces."""
    import numpy as np

    from paramshard.client import tools

    if not args.out.endswith((".npy", ".safetensors")):
        raise CommandError("--out must end in .npy or .safetensors", EXIT_USAGE)
    _check_out("--out", args.out)
    values = _run(args, tools.get_param, args.job, args.param)
    try:
        if args.out.endswith(".safetensors"):
            from safetensors.numpy import save_file

            save_file({args.param: np.ascontiguousarray(values)}, args.out)
        else:
            np.save(args.out, values)
    except OSError as exc:  # checked before, changed since
        raise CommandError(f"--out {args.out}: {exc.strerror or exc}") from None
    print(f"{args.param}: {list(values.shape)} -> {args.out}")
    return 0


@command(
    arg("job"), arg("--tag", required=True, help="the snapshot's name"), SERVERS, RUN, JSON, TIMEOUT
)
def snapshot(args: argparse.Namespace) -> int:
    """Snapshot a job on one version while it trains; each server writes its shard into its
    --snapshot-dir, then the manifest is committed."""
    from paramshard.client import tools

    manifest = _run(args, tools.snapshot, args.job, args.tag)
    if args.json:
        print(json.dumps(manifest, indent=1))
    elif "parts" in manifest:  # a 3D job: one snapshot per (stage, tensor rank) part
        shards = sorted({len(s) for s in manifest["servers"].values()})
        print(
            f"snapshot {args.job}/{args.tag}: version {manifest['version']},"
            f" {len(manifest['parts'])} parts ({', '.join(manifest['parts'])}),"
            f" {' or '.join(map(str, shards))} shards each (their data-parallel group's servers)"
        )
    else:
        print(
            f"snapshot {args.job}/{args.tag}: version {manifest['version']},"
            f" {manifest['num_servers']} shards, {len(manifest['buffers'])} buffers"
        )
    return 0


@command(
    arg("job", nargs="?", default="", help="only this job (as the other tools name it)"),
    arg("--job", dest="job_option", default="", metavar="JOB", help="the same"),
    arg(
        "--torn",
        action="store_true",
        help="also the torn tags (shards, no manifest: never committed, or a snapshot being"
        " taken now), one row per part",
    ),
    SERVERS,
    RUN,
    JSON,
    TIMEOUT,
)
def snapshots(args: argparse.Namespace) -> int:
    """The complete snapshots in server 0's snapshot directory (a 3D job's parts under one
    tag: one row, by the base name); with --torn, the torn tags after them (delete them with
    paramshard delete-snapshot)."""
    from paramshard.client import tools

    if args.job and args.job_option and args.job != args.job_option:
        raise CommandError(f"two jobs: {args.job!r} and --job {args.job_option!r}", EXIT_USAGE)
    rows = _run(args, tools.list_snapshots, args.job or args.job_option, True, args.torn)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    state = ["STATE"] if args.torn else []
    print(
        table(
            ["JOB", "TAG", "VERSION", "SERVERS", "PARTS", *state],
            [
                [
                    r["job"],
                    r["tag"],
                    str(r["version"]),
                    str(r["num_servers"]),
                    str(len(r.get("parts", [r["job"]]))),
                    *(["torn" if r.get("torn") else "complete"] if args.torn else []),
                ]
                for r in rows
            ],
            frozenset({2, 3, 4}),
        )
    )
    return 0


@command(
    arg("job"),
    arg("--tag", default="latest", help="snapshot to load (default: latest)"),
    arg(
        "--contributors",
        type=int_in(0, 2**32 - 1),
        default=0,
        help="data-parallel ranks from now on (default: as in the snapshot)",
    ),
    SERVERS,
    RUN,
    TIMEOUT,
)
def restore(args: argparse.Namespace) -> int:
    """Load a snapshot into these servers; their number may differ from the snapshot's."""
    from paramshard.client import tools

    version = _run(args, tools.restore, args.job, args.tag, args.contributors)
    print(f"restored {args.job}/{args.tag} at version {version}")
    return 0


@command(
    arg("job", help="the job name (a 3D job's base name: every part)"), SERVERS, RUN, JSON, TIMEOUT
)
def drop(args: argparse.Namespace) -> int:
    """Drop a job from every server that holds it (a 3D job: every part): its parameters,
    optimizer state, pending steps and replicas. Its snapshots stay. Ranks that still train
    it fail at their next call; a job the servers keep after its run ended must be dropped
    before a run of another layout registers the name."""
    from paramshard.client import tools

    names = _run(args, tools.drop, args.job)
    print(json.dumps(names) if args.json else "dropped " + ", ".join(names))
    return 0


@command(
    arg("job"),
    arg("--tag", action="append", default=[], help="a snapshot to delete (repeatable)"),
    arg(
        "--keep-last",
        type=int_in(1),
        metavar="K",
        help="instead: delete all but the K snapshots taken last, and torn tags older than"
        " the newest",
    ),
    arg(
        "--prefix",
        help="with --keep-last: only tags PREFIX-<step>[-e<epoch>][.<n>], as train_with_recovery"
        " names its checkpoints (tag_prefix, 'auto' by default)",
    ),
    SERVERS,
    RUN,
    JSON,
    TIMEOUT,
    name="delete-snapshot",
)
def delete_snapshot(args: argparse.Namespace) -> int:
    """Delete snapshots from every server's --snapshot-dir: the manifest first (the tag stops
    counting), then its shard files. Refused for a tag a server is writing or restoring."""
    from paramshard.client import tools

    if bool(args.tag) == (args.keep_last is not None):
        raise CommandError("give --tag TAG (one or more) or --keep-last K", EXIT_USAGE)
    if args.prefix is not None and args.keep_last is None:
        raise CommandError("--prefix goes with --keep-last", EXIT_USAGE)
    if args.keep_last is not None:
        gone = _run(args, tools.prune_snapshots, args.job, args.keep_last, args.prefix)
        if not gone and not args.json:
            print(f"nothing to delete: job {args.job} has at most {args.keep_last} such snapshots")
        return _said(gone, args.json)
    gone, failed = [], []
    for tag in dict.fromkeys(args.tag):  # each tag on its own: one missing stops no other
        try:
            gone.append(_run(args, tools.delete_snapshot, args.job, tag))
        except CommandError as exc:
            failed.append(str(exc))
    _said(gone, args.json)
    if failed:
        raise CommandError("; ".join(failed))
    return 0


def _said(gone: list[dict[str, Any]], as_json: bool) -> int:
    """Prints what ``delete-snapshot`` removed; 0."""
    if as_json:
        print(json.dumps(gone, indent=1))
        return 0
    for g in gone:
        torn = "" if g["complete"] else " (torn: no manifest)"
        kept = f"; left what no snapshot writes: {', '.join(g['kept'])}" if "kept" in g else ""
        print(
            f"deleted {g['job']}/{g['tag']}{torn}: {g['files']} files, {g['bytes']:,} bytes{kept}"
        )
    return 0


@command(
    arg("job", nargs="?", help="the job (live export; not with --snapshot)"),
    arg(
        "--snapshot",
        metavar="DIR",
        help="a snapshot folder <snapshot-dir>/<job>/<tag>: export offline, no server needed",
    ),
    arg("--out", help="the .safetensors file to write (the state dict)"),
    arg(
        "--hf-dir",
        metavar="DIR",
        help="instead: DIR/config.json + DIR/model.safetensors, loadable with"
        " from_pretrained(DIR) (a Hugging Face model's job)",
    ),
    SERVERS,
    RUN,
    TIMEOUT,
)
def export(args: argparse.Namespace) -> int:
    """Write a job's full state dict under the model's own names, or a Hugging Face folder.

    --out FILE is loadable with model.load_state_dict(safetensors.torch.load_file(FILE));
    --hf-dir DIR with from_pretrained(DIR). Streamed, one parameter at a time."""
    if (args.out is None) == (args.hf_dir is None):
        raise CommandError("give one of --out FILE or --hf-dir DIR", EXIT_USAGE)
    if args.out is not None:
        _check_out("--out", args.out)
        from paramshard.protos.atomic import replaced_file

        try:  # a link is followed; a device, fifo or socket is refused before anything is read
            replaced_file(args.out)
        except OSError as exc:
            raise CommandError(f"--out {args.out}: {exc.strerror or exc}", EXIT_USAGE) from None
    else:
        _check_out("--hf-dir", args.hf_dir, folder=True)
    if args.snapshot:
        try:
            count = export_snapshot(Path(args.snapshot), args.out, hf_dir=args.hf_dir)
        except OSError as exc:  # writing the output (checked before, changed since), as _run
            raise CommandError(f"{exc.filename}: {exc.strerror or exc}") from None
    elif args.job:
        from paramshard.client import tools
        from paramshard.client.export_hf import export_hf

        fn = export_hf if args.hf_dir is not None else tools.export
        count = _run(args, fn, args.job, args.hf_dir or args.out)
    else:
        raise CommandError("give a JOB (live servers) or --snapshot DIR", EXIT_USAGE)
    print(f"{count} tensors -> {args.hf_dir or args.out}")
    return 0
