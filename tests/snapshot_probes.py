"""Hostile snapshot folders' helpers (tests/test_hostile_snapshots.py): a server holding job 'j'
with a complete snapshot 't1', tags planted beside it by hand (docs/security.md: whoever can
write in the snapshot directory can plant a tag), a server process whose address space is
bounded (a probe that makes a server allocate without bound ends in MemoryError there, never
in the host's memory), and the CLI run in a line. Raw calls: tests/replica_probes.py."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from replica_probes import (
    HOSTILE_TOKENS,
    NUMEL,
    PARAMS,
    Code,
    call,
    code_of,
    crafted,
    hold_job,
    refused,
    state,
)
from server_processes import ROOT, ServerProcess
from test_hardening_replication import TOKENS, client_for

from paramshard.client import ClusterSpec, ShardClient, checkpoints
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer

SHARD = "shard-0-of-1.safetensors"
ADDRESS_SPACE_MARGIN = 6 * 2**30
"""What a bounded server process may map beyond what it mapped once listening."""


def take_snapshot(address: str) -> None:
    """Job 'j' (buffer 'w' of NUMEL elements, slice 0 of 1) is on the server: snapshot 't1'."""
    admin = client_for([address])
    try:
        checkpoints.snapshot(admin, "j", "t1")
    finally:
        admin.close()


def snapshot_server(servers: Any, root: Path) -> ShardServer:
    """An in-process server with tokens, snapshot folder ``root``, job 'j' and snapshot 't1'."""
    (node,) = servers(1, tokens=HOSTILE_TOKENS, snapshot_dir=str(root), local_calls=False)
    hold_job(node.address)
    take_snapshot(node.address)
    return node


def plant(
    root: Path,
    tag: str,
    change: Callable[[dict[str, Any]], Any] | None = None,
    shard: bytes | None = None,
) -> Path:
    """Tag ``tag`` of job 'j', a copy of 't1': its shard replaced by ``shard`` (the manifest's
    bytes and sha256 made to match, as whoever planted it would), then its manifest changed
    by ``change``. Returns the folder."""
    folder = root / "j" / tag
    shutil.copytree(root / "j" / "t1", folder)
    for path in folder.iterdir():
        path.chmod(0o644)
    manifest = json.loads((folder / "manifest.json").read_text())
    if shard is not None:
        (folder / SHARD).write_bytes(shard)
        digest = hashlib.sha256(shard).hexdigest()
        manifest["shards"][0].update(bytes=len(shard), sha256=digest)
    if change is not None:
        change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def shard_of(version: Any = 0, step_count: Any = 0, tensors: dict[str, Any] | None = None) -> bytes:
    """A shard of job 'j' written by hand (replica_probes.crafted): any version, step count or
    tensors (name -> (dtype, shape, bytes, data_offsets or None))."""
    layout = {"w": {"slice_start": 0, "slice_numel": NUMEL, "step_count": step_count, "state": []}}
    params = {"w::params": ("F32", [NUMEL], PARAMS.tobytes(), None)}
    return crafted("j", version, layout, params if tensors is None else tensors)


def restore(tag: str) -> pb.RestoreRequest:
    return pb.RestoreRequest(job="j", tag=tag, server_index=0, num_servers=1)


def refused_then_put_back(node: ShardServer, tag: str) -> tuple[Any, Any]:
    """A Restore of planted ``tag`` refused FAILED_PRECONDITION, then job 'j' restored from
    't1' whatever happened: (the server's ``state`` before, and right after the refusal)."""
    before = state(node)
    try:
        refused(node.address, "Restore", restore(tag), Code.FAILED_PRECONDITION)
    finally:
        after = state(node)
        call(node.address, "Restore", restore("t1"))
    return before, after


def listed(address: str, **kw: object) -> list[str]:
    out = call(address, "ListSnapshots", pb.ListSnapshotsRequest(**kw), "reader-secret")
    assert isinstance(out, pb.ListSnapshotsReply), f"{code_of(out)}: {out.details()}"
    return [s.tag for s in out.snapshots]


def restore_within(address: str, tag: str, seconds: float) -> tuple[object, float]:
    """Restore of ``tag`` with a deadline: (reply or ShardClientError, seconds it took)."""
    spec = ClusterSpec([address], token="admin-secret")
    client, began = ShardClient(spec, timeout_s=seconds, retries=0), time.monotonic()
    try:
        return client.call(0, "Restore", restore(tag)), time.monotonic() - began
    except ShardClientError as exc:
        return exc, time.monotonic() - began
    finally:
        client.close()


def sparse(path: Path, size: int) -> Path:
    """``path`` made a sparse file of ``size`` bytes (nothing written: no disk used)."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@contextmanager
def bounded_server(root: Path, monkeypatch: Any) -> Iterator[ServerProcess]:
    """``paramshard serve`` with tokens (TOKENS) and snapshot folder ``root`` holding
    job 'j' and snapshot 't1', its address space bounded to what it mapped once listening plus
    ADDRESS_SPACE_MARGIN; killed at the end (a thread spinning in it goes with it)."""
    tokens = root.parent / "tokens"
    tokens.write_text("".join(f"{role} {token}\n" for token, role in TOKENS.items()))
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # a thread's arena is not counted against it
    server = ServerProcess(root)
    server.start("--token-file", str(tokens), "--workers", "16")
    try:
        assert server.proc is not None
        status = Path(f"/proc/{server.proc.pid}/status").read_text()
        mapped = int(next(x for x in status.splitlines() if x.startswith("VmSize")).split()[1])
        limit = mapped * 1024 + ADDRESS_SPACE_MARGIN
        resource.prlimit(server.proc.pid, resource.RLIMIT_AS, (limit, limit))
        hold_job(server.address)
        take_snapshot(server.address)
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.kill()


_BOUNDED_MAIN = (
    "import resource, runpy, sys; limit = int(sys.argv.pop(1));"
    " limit and resource.setrlimit(resource.RLIMIT_AS, (limit, limit));"
    " sys.argv[0] = 'paramshard'; runpy.run_module('paramshard', run_name='__main__')"
)


def cli(*args: str, timeout: float = 60, address_space: int = 0) -> tuple[int | None, str, float]:
    """``paramshard ARGS`` in a process, its address space bounded when asked: (exit code,
    stderr, seconds); exit code None when it ran past ``timeout`` (then killed)."""
    began = time.monotonic()
    env = {**os.environ, "PARAMSHARD_TOKEN": "admin-secret", "MALLOC_ARENA_MAX": "2"}
    cmd = [sys.executable, "-c", _BOUNDED_MAIN, str(address_space), *args]
    with subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            return None, err, time.monotonic() - began
    return proc.returncode, err, time.monotonic() - began


def one_line_error(rc: int | None, err: str, command: str) -> None:
    """The CLI's way to fail: non-zero, one line naming the command, no traceback."""
    assert rc not in (0, None), (rc, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"paramshard {command}: error:"), err[-2000:]
    assert "Traceback" not in err and "INTERNAL" not in err, err[-2000:]


__all__ = [
    "ADDRESS_SPACE_MARGIN",
    "SHARD",
    "bounded_server",
    "cli",
    "listed",
    "one_line_error",
    "plant",
    "restore",
    "restore_within",
    "shard_of",
    "snapshot_server",
    "sparse",
    "take_snapshot",
]
