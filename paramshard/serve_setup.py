"""What ``paramshard serve`` does around the server: the glibc malloc re-exec, the exposure
check (a non-loopback address needs TLS, a token or --insecure), reading TLS files, the check
that its port is free, and restoring this server's part of a snapshot at start."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from paramshard.commands import (
    EXIT_USAGE,
    CommandError,
    paramshard_argv,
    warn,
)
from paramshard.protos.hosts import is_loopback  # noqa: F401 - serve_cli's, and the tests'

REEXEC_GUARD = "PARAMSHARD_SERVE_REEXEC"


def restore_at_start(server: Any, args: argparse.Namespace) -> None:
    """``serve --restore TAG``: this server's part of TAG for every job with a snapshot.

    A snapshot records which servers of the cluster held the job: in a cluster of that size,
    this server takes back its own slice and skips jobs it did not hold (a 3D job's parts live
    on their data-parallel groups' servers). With another ``--num-servers``, every job is
    resharded over all of them."""
    from paramshard.client.tensor_parts import (
        PartsError,
        newest_complete_tag,
        parse_part_job,
        part_snapshots,
    )
    from paramshard.protos import shard_pb2 as pb
    from paramshard.protos.placement import recorded_placement, restore_slice
    from paramshard.server.runtime.errors import ShardError

    if not args.snapshot_dir or args.index is None:
        raise CommandError("--restore needs --snapshot-dir and --index", EXIT_USAGE)
    snaps = server.servicer.snapshots
    listed = snaps.list() if snaps.root.is_dir() else []
    for job in sorted({m["job"] for m in listed}):
        complete = {m["tag"]: m for m in listed if m["job"] == job}
        tag = args.restore
        part = parse_part_job(job)
        if tag == "latest" and part is not None:  # the newest tag every part of it has
            try:
                tag = newest_complete_tag(part[0], part_snapshots(part[0], listed))
            except PartsError as exc:
                raise CommandError(f"--restore latest of {job}: {exc}") from None
        elif tag == "latest":
            tag = snaps.latest(job)
        if tag not in complete:  # the restore below says what is wrong with it
            index, num = args.index, max(args.num_servers or 0, args.index + 1)
        else:
            size = args.num_servers or recorded_placement(complete[tag])[1]
            mine = restore_slice(complete[tag], size, args.index)
            if args.index >= size:  # refused below
                index, num = args.index, size
            elif mine is None:
                print(f"paramshard serve: {job}/{tag} is not on server {args.index}", flush=True)
                continue
            else:
                index, num = mine
        request = pb.RestoreRequest(job=job, tag=tag, server_index=index, num_servers=num)
        try:
            reply = server.servicer.restore(request, None)
        except ShardError as exc:
            raise CommandError(f"--restore {job}/{tag}: {exc.message}") from None
        print(
            f"paramshard serve: restored {job}/{reply.tag} at version {reply.version}", flush=True
        )


def reexec_with_malloc_env(argv: Sequence[str]) -> None:
    """Re-executes ``paramshard ARGV`` with the MALLOC_* settings if any is missing.

    docs/design.md §7.5: these glibc settings took a 256 MiB call from 0.35 to 0.96 GB/s, and glibc
    reads them only when the process starts, so setting ``os.environ`` now would do nothing.
    Values the user already set are kept. ``execve`` keeps the pid, so supervisors see no change.
    """
    from paramshard.server.app import MALLOC_ENV

    missing = {k: v for k, v in MALLOC_ENV.items() if k not in os.environ}
    if os.environ.pop(REEXEC_GUARD, None) is not None:  # we are the re-executed process
        if missing:
            warn(f"{', '.join(missing)} still unset after re-executing; serving without them")
        return
    if not missing:
        return
    if not sys.executable:
        warn(f"cannot re-execute to set {', '.join(missing)}: no sys.executable")
        return
    env = {**os.environ, **missing, REEXEC_GUARD: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, paramshard_argv(*argv), env)
    except OSError as exc:
        warn(f"cannot re-execute to set {', '.join(missing)}: {exc}; serving without them")


def raise_open_files_limit() -> None:
    """Raises this process's soft limit on open descriptors to its hard limit, as servers
    commonly do: each shared segment holds two descriptors and each connection one, and the
    server holds only as many segments as the soft limit leaves room for
    (server/transport/segment_files.py). 1,024, a common soft default, leaves room for 384."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard not in (soft, resource.RLIM_INFINITY):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, OSError, ValueError) as exc:  # not Unix, or not allowed: keep it
        warn(f"could not raise the open-files limit: {exc}")


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_port_free(host: str, port: int) -> None:
    """Says in words that ``host``:``port`` is taken, before grpc tries it: grpc's C core
    logs lines of its own first (``add_port.cc``), then raises. Port 0 picks a free one; a
    name that does not resolve is left to grpc's words; a port taken after this check still
    fails in grpc."""
    if port == 0:
        return
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        return
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc binds
            try:
                probe.bind(address)
            except OSError as exc:
                raise CommandError(
                    f"cannot listen on {join_host_port(host, port)}: {exc.strerror or exc}"
                ) from None
