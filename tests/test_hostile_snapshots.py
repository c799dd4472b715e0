"""Hostile snapshot folders: tags planted or tampered with by whoever can write in the snapshot
directory (docs/security.md, server/snapshots/folders.py), read by Restore, ListSnapshots and
``paramshard export --snapshot`` over real gRPC against real servers on 127.0.0.1.

These are defects a probe found (docs/security.md 136-145; each docstring says what the code
did, and each failed on it); what held is in tests/test_hostile_snapshot_inputs.py. After
each call: no INTERNAL or UNKNOWN, a message saying what was wrong, bounded time, Status and
a trainer's pull still answer, and the job and the memory account as they were
(replica_probes.state). Helpers: tests/snapshot_probes.py."""

from __future__ import annotations

import os
import time

import grpc
import numpy as np
import pytest
from replica_probes import NUMEL, PARAMS, Code, call, code_of, refused, state
from safetensors import safe_open
from snapshot_probes import (
    SHARD,
    bounded_server,
    cli,
    listed,
    one_line_error,
    plant,
    refused_then_put_back,
    restore,
    restore_within,
    shard_of,
    snapshot_server,
    sparse,
)

from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb

TiB = 2**40


@pytest.fixture
def planted(servers, tmp_path):
    """(server, snapshot root): job 'j' and its complete snapshot 't1'."""
    root = tmp_path / "snaps"
    return snapshot_server(servers, root), root


# ------------------------------------------------------------------------------- defects
LIES = {
    "header length 2**63": lambda real: (2**63).to_bytes(8, "little") + real[8:],
    "header length past the end": lambda real: len(real).to_bytes(8, "little") + real[8:],
    "empty header": lambda real: bytes(8),
    "data offsets past the end": lambda real: shard_of(
        tensors={"w::params": ("F32", [NUMEL], PARAMS.tobytes(), [0, 10**6])}
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lie", LIES)
def test_a_shard_whose_safetensors_header_lies_is_refused(planted, lie: str) -> None:
    """A planted tag whose shard's safetensors header lies (its manifest's bytes and sha256
    matching it): Restore ends INTERNAL ("SafetensorError: Error while deserializing header:
    header too large" / "invalid header length" / "header too small" / "invalid shape, data
    type, or offset for tensor"). shards.py ``shard_meta`` catches OSError, ValueError, KeyError,
    TypeError and RuntimeError, but safetensors' SafetensorError derives from Exception only
    (``read_range`` does catch it). ``paramshard restore`` prints "... Restore: INTERNAL: ...".
    Expected: FAILED_PRECONDITION naming the shard file; the job unchanged (it is)."""
    node, root = planted
    plant(root, "lie", shard=LIES[lie]((root / "j" / "t1" / SHARD).read_bytes()))
    before = state(node)
    assert SHARD in refused(node.address, "Restore", restore("lie"), Code.FAILED_PRECONDITION)
    assert state(node) == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [float("inf"), -1, 2.5, "12", True])
def test_a_shard_step_count_that_is_not_a_count_is_refused(planted, count) -> None:
    """A planted shard whose layout says ``"step_count": Infinity`` (JSON as Python writes it):
    files.py ``layout`` did ``int(info["step_count"])``, OverflowError, which it did not
    catch: Restore ended INTERNAL ("OverflowError: cannot convert float infinity to
    integer"). -1, 2.5, "12" and true were taken as 0, 2, 12 and 1. Now each is refused
    (FAILED_PRECONDITION), as NaN and 1e300 were."""
    node, root = planted
    plant(root, "inf", shard=shard_of(step_count=count))
    before = state(node)
    details = refused(node.address, "Restore", restore("inf"), Code.FAILED_PRECONDITION)
    assert "step" in details
    assert state(node) == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "name, version",
    [(SHARD, True), (SHARD, -1), (SHARD, 2**64), ("shard-0-of-99999999999.safetensors", 1)],
)
def test_a_torn_tags_shard_cannot_break_listings(planted, name: str, version: object) -> None:
    """A planted torn tag (a folder holding one shard file, no manifest) whose shard header
    says ``"version": true`` (or -1, or 2**64), or whose file name says 99,999,999,999 servers:
    deletion.py ``torn_tags`` takes ``shard_version`` (any int, a bool included) and
    ``int(group(1))`` as they are, and snapshot_calls.py ``list`` builds SnapshotInfo from them:
    ListSnapshots with ``torn`` ends INTERNAL ("TypeError: Field
    paramshard.v1.SnapshotInfo.version: Expected an int, got a boolean." / "ValueError: Value
    out of range: -1"), for the job and for every job (a reader's call). So ``paramshard
    snapshots --torn`` and every prune (``delete-snapshot --keep-last``, which lists torn tags)
    of the job fail ("... ListSnapshots: INTERNAL: ..."). Expected: listed with version 0 (as
    a header that cannot be read is) or skipped and logged."""
    node, root = planted
    (root / "j" / "torn").mkdir()
    (root / "j" / "torn" / name).write_bytes(shard_of(version))
    assert "t1" in listed(node.address, job="j", torn=True)
    assert "t1" in listed(node.address, torn=True)
    rc, err, _ = cli("snapshots", "j", "--torn", "--servers", node.address)
    assert rc == 0, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", [2**53 + 1, 2**64 - 1])
def test_a_restored_version_is_bounded_as_a_clients_is(planted, version: int) -> None:
    """docs/security.md bounds the versions a client sets (SetParams, or a replica it loads)
    at 2**53; manifest_schema.py takes a manifest's version up to 2**64 - 1. A planted tag at
    version 2**64 - 1 (manifest and shard agreeing) restores OK; the trainer's next Step ends
    INTERNAL ("ValueError: Value out of range: 18446744073709551616") and from then on every
    Status of the server (any reader's) and every PullParams of the job end INTERNAL, until
    the job is dropped or restored again. 2**53 + 1 restores too. Expected: refused, naming the
    version, as LoadReplica refuses it."""
    node, root = planted
    plant(root, "far", shard=shard_of(version), change=lambda m: m.update(version=version))
    before = state(node)
    try:
        out = call(node.address, "Restore", restore("far"))
        assert code_of(out) in (Code.FAILED_PRECONDITION, Code.INVALID_ARGUMENT), out
        assert "version" in out.details()
    finally:
        call(node.address, "Restore", restore("t1"))  # back as it was, whatever happened
    assert state(node) == before


@pytest.mark.timeout(60)
def test_a_manifest_past_the_placement_bound_is_skipped_and_refused(planted) -> None:
    """A planted manifest with ``num_servers`` 4,194,304 (manifest_schema.py takes up to
    2**32 - 1; docs/security.md bounds placements at 65,536 servers): placement.py
    ``recorded_placement`` makes ``list(range(num_servers))`` for its row, so ListSnapshots
    of every job answers 14.7 MB: RESOURCE_EXHAUSTED ("Received message larger than max
    (14663620 vs. 4194304)"), naming nothing. At 2**32 - 1 it builds a 4-billion-entry list
    (34 GB; MemoryError, INTERNAL, under an 8 GiB address-space limit). Expected: skipped by
    listings, Restore FAILED_PRECONDITION naming num_servers."""
    node, root = planted
    plant(root, "wide", change=lambda m: m.update(num_servers=2**22))
    assert listed(node.address) == ["t1"]
    details = refused(node.address, "Restore", restore("wide"), Code.FAILED_PRECONDITION)
    assert "num_servers" in details


@pytest.mark.timeout(180)
def test_a_manifest_of_2_32_servers_is_refused_at_once(tmp_path, monkeypatch) -> None:
    """A planted manifest with ``num_servers`` 2**32 - 1 and the real shard listed (a server
    process whose address space is bounded): files.py ``read_range`` calls ``slicing.pieces``,
    which computes the bounds of every one of the 4,294,967,295 old slices in Python. Restore
    (10 s deadline) ends DEADLINE_EXCEEDED while the server's thread goes on burning a core
    for about half an hour (1.7 s per 4M slices here), the tag held against DeleteSnapshot all
    along; each further Restore takes another thread. ``paramshard export --snapshot`` of it
    spins the same way (``py-spy dump``: ``slice_bounds`` < ``pieces`` < ``read_range`` <
    ``_export_plain``). Expected: FAILED_PRECONDITION at once naming num_servers (or a
    ``pieces`` that visits only the slices overlapping the range)."""
    root = tmp_path / "snaps"
    with bounded_server(root, monkeypatch) as server:
        plant(root, "wide", change=lambda m: m.update(num_servers=2**32 - 1))
        out, took = restore_within(server.address, "wide", 10)
        assert isinstance(call(server.address, "Status", pb.StatusRequest()), pb.StatusReply)
    assert isinstance(out, ShardClientError), out
    assert out.code == grpc.StatusCode.FAILED_PRECONDITION, (out.code, out.details, took)
    assert "num_servers" in out.details


@pytest.mark.timeout(180)
def test_a_huge_manifest_is_refused_by_its_size(tmp_path, monkeypatch) -> None:
    """A planted ``manifest.json`` that is a 1 TiB sparse file: folders.py ``Folder.read`` reads
    a file whole (``f.read()``), with no bound, for Restore (``load_manifest``) and for every
    listing (``_listed``). In a server process whose address space is bounded: Restore and
    ListSnapshots of every job end INTERNAL ("MemoryError"); unbounded, a host with more
    memory reads it all (a 200 MiB manifest: peak resident 90 -> 490 MiB, outside the memory
    account). Expected: FAILED_PRECONDITION naming its size, unread; skipped by listings."""
    root = tmp_path / "snaps"
    with bounded_server(root, monkeypatch) as server:
        folder = plant(root, "huge")
        sparse(folder / "manifest.json", TiB)
        try:
            out = call(server.address, "Restore", restore("huge"))
            tags = listed(server.address)
        finally:
            os.truncate(folder / "manifest.json", 0)
    assert code_of(out) == Code.FAILED_PRECONDITION and "manifest.json" in out.details()
    assert tags == ["t1"]


@pytest.mark.timeout(90)
def test_a_shard_far_larger_than_its_manifest_says_is_refused_before_it_is_read(planted) -> None:
    """A planted tag whose shard is a 1 TiB sparse file, its manifest saying 312 bytes: files.py
    ``_digest`` reads and hashes the whole file before ``load_manifest`` compares its size with
    the manifest's (4 GiB took 7 s here: 1 TiB is about half an hour of a core). Restore (10 s
    deadline) ends DEADLINE_EXCEEDED while the thread goes on hashing, the tag held against
    DeleteSnapshot. (The test cuts the file to 0 bytes afterwards, which ends that read.)
    Expected: the size (fstat) compared first, FAILED_PRECONDITION at once naming the file."""
    node, root = planted
    folder = plant(root, "sparse")
    before = state(node)
    sparse(folder / SHARD, TiB)
    try:
        out, took = restore_within(node.address, "sparse", 10)
    finally:
        os.truncate(folder / SHARD, 0)
        for _ in range(300):  # the thread reading it sees the end and lets the tag go
            if not node.servicer.snapshot_calls._using:
                break
            time.sleep(0.1)
    assert state(node) == before
    assert isinstance(out, ShardClientError), out
    assert out.code == grpc.StatusCode.FAILED_PRECONDITION, (out.code, out.details, took)
    assert SHARD in out.details


@pytest.mark.timeout(60)
def test_a_manifest_must_list_every_shard_it_restores(planted) -> None:
    """A restore reads ``shard-<i>-of-<num_servers>`` by name (``read_range``) but checks the
    checksums only of the files the manifest's ``shards`` lists, and a listed manifest
    (non-strict ``check_manifest``) may list any number of them: ``"shards": []`` with a shard
    whose values were changed (same size) restores OK and loads the changed values; no
    checksum was read. (The same laxness lets a manifest list one shard 1,000 times: it is
    hashed 1,000 times.) files.py promises "any missing, truncated, corrupt or mismatched file
    is an error that names the file, and nothing is loaded". Expected: FAILED_PRECONDITION
    unless ``shards`` lists each of the num_servers shards once; the job unchanged."""
    node, root = planted
    real = (root / "j" / "t1" / SHARD).read_bytes()
    changed = real[: -4 * NUMEL] + (PARAMS + 100).tobytes()  # the values, at the file's end
    folder = plant(root, "unlisted", change=lambda m: m.update(shards=[]))
    (folder / SHARD).write_bytes(changed)
    before, after = refused_then_put_back(node, "unlisted")
    assert after == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype, data", [("F64", np.full(NUMEL, 1e300)), ("I64", np.arange(NUMEL))])
def test_a_shard_tensor_of_another_dtype_is_refused(planted, dtype: str, data) -> None:
    """A planted shard whose ``w::params`` is F64 (or I64) while the manifest says the buffer's
    master dtype is float32: ``read_range`` checks the tensor's shape (``check_held``), not its
    dtype, and numpy casts on assignment. Restore answers OK and the job's params become inf
    (1e300 cast to float32: non-finite parameters that no SetParams could send) or the
    integers. Expected: FAILED_PRECONDITION naming the file and both dtypes."""
    node, root = planted
    tensors = {"w::params": (dtype, [NUMEL], data.tobytes(), None)}
    plant(root, "cast", shard=shard_of(tensors=tensors))
    before, after = refused_then_put_back(node, "cast")
    assert after == before


def _one_param(m: dict, servers: int = 1, **offset: int) -> None:
    m["buffers"]["w"]["params"] = [{"name": "w", "shape": [NUMEL], "numel": NUMEL, **offset}]
    m["num_servers"] = servers


EXPORTS = {
    "a 1 TiB manifest": (None, TiB),
    "num_servers 2**32 - 1": (lambda m: _one_param(m, 2**32 - 1, offset=0), 0),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", EXPORTS)
def test_offline_export_of_a_hostile_tag_is_one_line(planted, tmp_path, case: str) -> None:
    """``paramshard export --snapshot DIR --out F`` of a planted tag (its address space bounded
    at 8 GiB, its time at 30 s):
    - a 1 TiB sparse manifest: read whole, a traceback ending "MemoryError";
    - ``num_servers`` 2**32 - 1: it spins in ``slicing.pieces`` (about half an hour).
    Expected: one line "paramshard export: error: ..." saying what was wrong, non-zero."""
    _, root = planted
    change, size = EXPORTS[case]
    folder = plant(root, "bad", change=change)
    if size:
        sparse(folder / "manifest.json", size)
    out = tmp_path / "out.safetensors"
    try:
        rc, err, _ = cli("export", "--snapshot", str(folder), "--out", str(out), timeout=30,
                         address_space=8 * 2**30)  # fmt: skip
    finally:
        if size:
            os.truncate(folder / "manifest.json", 0)
    one_line_error(rc, err, "export")


def test_offline_export_takes_a_missing_offset_as_a_restore_does(planted, tmp_path) -> None:
    """A parameter entry without ``offset`` is at offset 0 for the manifest's checks and a
    Restore; the offline export read ``p["offset"]`` and ended in a 25-line traceback
    ("KeyError: 'offset'")."""
    _, root = planted
    folder = plant(root, "bare", change=_one_param)
    out = tmp_path / "out.safetensors"
    rc, err, _ = cli("export", "--snapshot", str(folder), "--out", str(out), timeout=60)
    assert rc == 0, err[-2000:]
    with safe_open(str(out), framework="numpy") as f:
        np.testing.assert_array_equal(f.get_tensor("w"), PARAMS)
