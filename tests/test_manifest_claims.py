"""A snapshot's manifest is a caller's file (CommitSnapshot): a Restore reads from the shard
files only what they hold as the manifest says (server/snapshots/files.py, ``read_range``).

Found by a hostile probe: a manifest whose buffer had more elements than its shard held was
committed, and its Restore ended INTERNAL (safetensors' own error, out of bounds); one that
named a buffer no shard held restored it as zeros, initialized, and said OK.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient, tools
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb

pytestmark = pytest.mark.timeout(120)
N = 8
VALUES = np.arange(N, dtype=np.float32)


@pytest.fixture
def snapshotted(servers, tmp_path: Path) -> Any:
    """(client, root): job 'j' at version 1 with a complete snapshot 'real'."""
    root = tmp_path / "snaps"
    (server,) = servers(1, snapshot_dir=str(root))
    c = ShardClient(ClusterSpec([server.address]), timeout_s=15, retries=0)
    c.register_buffer("j", "w", N, optimizer="sgd", hyper={"lr": 0.1})
    c.set_params("j", "w", VALUES, version=1)
    tools.snapshot(c, "j", "real")
    yield c, root
    c.close()


def commit_claiming(c: ShardClient, root: Path, tag: str, claim: Callable[[dict], None]) -> None:
    """A snapshot ``tag`` of job 'j' whose shard is the server's own and whose manifest is
    the real one changed by ``claim``."""
    shard = c.call(0, "Snapshot", pb.SnapshotRequest(job="j", tag=tag, version=1, num_servers=1))
    manifest = json.loads((root / "j" / "real" / "manifest.json").read_text())
    manifest["tag"] = tag
    (entry,) = manifest["shards"]
    entry.update(file=shard.file, bytes=shard.bytes, sha256=shard.sha256)
    claim(manifest["buffers"])
    request = pb.CommitSnapshotRequest(job="j", tag=tag, manifest_json=json.dumps(manifest))
    c.call(0, "CommitSnapshot", request)  # the manifest's own checks pass


def more_elements(buffers: dict) -> None:
    buffers["w"]["numel"] = 2 * N


def a_buffer_of_its_own(buffers: dict) -> None:
    buffers["ghost"] = {**buffers["w"], "numel": 1000, "params": []}


@pytest.mark.parametrize(
    "claim, says",
    [
        (more_elements, f"shape [{N}], the manifest's {2 * N} elements"),
        (a_buffer_of_its_own, "cannot read ghost params (the shard holds no such tensor)"),
    ],
)
@pytest.mark.parametrize("check_only", [True, False])
def test_a_manifest_that_claims_what_its_shards_do_not_hold_restores_nothing(
    snapshotted, claim: Callable[[dict], None], says: str, check_only: bool
) -> None:
    c, root = snapshotted
    commit_claiming(c, root, "t", claim)
    with pytest.raises(ShardClientError) as info:
        c.call(0, "Restore", pb.RestoreRequest(job="j", tag="t", num_servers=1,
                                               check_only=check_only))  # fmt: skip
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION, info.value
    assert says in info.value.details, info.value.details
    (job,) = c.call(0, "Status", pb.StatusRequest()).jobs  # job 'j' as it was
    assert [(b.buffer, b.numel) for b in job.buffers] == [("w", N)]
    np.testing.assert_array_equal(c.pull_params("j", "w", N), VALUES)
    tools.restore(c, "j", "real")  # the real snapshot still restores
