"""The client library and the ``paramshard`` tools against a server that lies.

Every earlier review probed the servers with hostile callers; these tests turn it around: a
server an attacker runs at an address a user was told to inspect, a compromised host of a
cluster, or a buggy peer answers the real client code (tests/lying_servers.py). Whatever it
sends, a client must not act for it on this host (connect to a local socket it names), must not
allocate or enumerate what it merely claims, must not turn a short or wrong reply into silently
wrong values, must not print its control characters to the user's terminal, and must fail with
one line that names the server, never a traceback.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import grpc
import numpy as np
import pytest
from lying_servers import (
    AbstractListener,
    MemfdHandover,
    job_status,
    lying_server,
    pull_reply,
    run_cli,
)

from paramshard.client import ClusterSpec, ShardClient, ShardClientError, tools
from paramshard.client.chunk_size import MAX_REPLY_BYTES
from paramshard.client.export import VersionChangedError
from paramshard.protos import shard_pb2 as pb

MEMORY_LIMIT = 1 << 30
"""A tool's address space in these tests: what a lying server claims must not need more."""
ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[31m"
"""An OSC title change, a screen clear and a colour: what a server's strings must not carry to
the user's terminal."""


def _client(address: str, **kw: Any) -> ShardClient:
    return ShardClient(ClusterSpec([address]), timeout_s=5, retries=1, **kw)


def _one_line_error(result: subprocess.CompletedProcess[str], address: str) -> None:
    """A tool failed with one line naming the server, no traceback."""
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert address in result.stderr, result.stderr[-2000:]


def _ok(request: Any, context: grpc.ServicerContext) -> Any:
    return pb.ReleaseSegmentsReply()


# -- shared memory: the handover socket and the segment are the server's word ----------------


def test_segment_handover_connects_to_no_socket_but_a_servers(monkeypatch) -> None:
    """OfferSegment's ``socket`` and ``ticket`` are sent by the server, and the client
    connected to whatever abstract socket it named and wrote the ticket's bytes there: a server
    on another host made every client that pulls 64 KiB from it talk to a local service of the
    client's host (D-Bus, X11, a container runtime's shim), with bytes of its choosing. Only a
    server's handover name and a ticket of its size are taken now; else the pull goes in-band."""
    monkeypatch.delenv("PARAMSHARD_SHM", raising=False)
    local = AbstractListener(f"local-service-{os.getpid()}")
    n = 32768  # 128 KiB: a pull through a segment

    def offer(request: Any, context: grpc.ServicerContext) -> pb.OfferSegmentReply:
        ticket = b"POST /containers/create HTTP/1.0\r\n\r\n"
        return pb.OfferSegmentReply(segment=1, socket="@" + local.name, ticket=ticket, nbytes=1)

    zeros = np.zeros(n, np.float32).tobytes()
    try:
        with lying_server(
            Status=lambda r, c: job_status("j", [("w", (n,))]),
            OfferSegment=offer,
            PullParams=lambda r, c: pull_reply(r, zeros),
        ) as server:
            client = _client(server.address)
            try:
                tools.get_param(client, "j", "w")
            finally:
                client.close()
        time.sleep(0.3)  # the listener's thread records what came
    finally:
        local.close()
    assert local.received == [], f"the client sent {local.received!r} to @{local.name}"


def test_reply_outside_its_segment_is_an_error_naming_the_server(monkeypatch) -> None:
    """A reply whose ShmRef lies outside the caller's segment was refused with a bare
    ValueError that named no server (and ``paramshard inspect`` printed a traceback): a
    DATA_LOSS error naming the server now."""
    monkeypatch.delenv("PARAMSHARD_SHM", raising=False)
    n = 32768
    handover = MemfdHandover()  # of the size the client asks: its segment is used

    def pull(request: Any, context: grpc.ServicerContext) -> pb.PullParamsReply:
        far = pb.ShmRef(segment=1, offset=2**40, nbytes=4 * n)
        header = pb.PullParamsHeader(ref=request.ref, chunk=request.chunk, version=1, shm=far)
        return pb.PullParamsReply(header=header)

    try:
        with lying_server(
            Status=lambda r, c: job_status("j", [("w", (n,))]),
            OfferSegment=handover.offer,
            ConfirmSegment=lambda r, c: pb.ConfirmSegmentReply(),
            ReleaseSegments=_ok,
            PullParams=pull,
        ) as server:
            client = _client(server.address)
            try:
                with pytest.raises(RuntimeError, match=server.address) as caught:
                    tools.get_param(client, "j", "w")
            finally:
                client.close()
    finally:
        handover.close()
    assert "outside the caller's segment" in str(caught.value), caught.value


def test_segment_of_another_size_than_asked_is_not_used(monkeypatch) -> None:
    """The client mapped the size the server's offer claimed, not the size it asked for,
    and copied a payload of up to the size it asked into it: a segment of 4 KiB made every
    push or parameter set fail with NumPy's "buffer is smaller than requested size". A segment
    of another size is not used now (the payload goes in-band)."""
    monkeypatch.delenv("PARAMSHARD_SHM", raising=False)
    handover = MemfdHandover(4096)
    try:
        with lying_server(
            OfferSegment=handover.offer,
            ConfirmSegment=lambda r, c: pb.ConfirmSegmentReply(),
            ReleaseSegments=_ok,
            SetParams=lambda r, c: pb.SetParamsReply(initialized=True),
        ) as server:
            client = _client(server.address)
            try:  # in-band, or an error naming the server: not NumPy's ValueError
                client.set_params("j", "b", np.zeros(32768, np.float32))
            except RuntimeError as exc:
                assert server.address in str(exc)
            finally:
                client.close()
    finally:
        handover.close()
    assert handover.received, "the client never took the segment: the size went unchecked"


# -- values: a reply must hold what was asked ------------------------------------------------


def test_pull_reply_of_one_value_is_not_spread_over_the_chunk(monkeypatch) -> None:
    """A PullParams reply's size was never compared with the chunk asked for; NumPy
    broadcast a reply of one value over the whole chunk, and the tools returned (inspect,
    get, export wrote) a tensor of 8 sevens without a word. DATA_LOSS naming the server now."""
    monkeypatch.setenv("PARAMSHARD_SHM", "0")
    seven = np.float32([7]).tobytes()
    with lying_server(
        Status=lambda r, c: job_status("j", [("w", (8,))]),
        PullParams=lambda r, c: pull_reply(r, seven),
    ) as server:
        client = _client(server.address)
        try:
            with pytest.raises(RuntimeError, match=server.address):
                values = tools.get_param(client, "j", "w")
                pytest.fail(f"got {values.tolist()} from a reply of one value")
        finally:
            client.close()


def test_short_pull_reply_is_one_line_naming_the_server() -> None:
    """3 values for a chunk of 8 ended ``paramshard inspect`` in a traceback,
    "ValueError: could not broadcast input array from shape (3,) into shape (8,)"."""
    with lying_server(
        Status=lambda r, c: job_status("j", [("w", (8,))]),
        PullParams=lambda r, c: pull_reply(r, b"\0" * 12),
    ) as server:
        result = run_cli(["inspect", "j", "--servers", server.address], timeout=30)
    _one_line_error(result, server.address)


def test_export_of_versions_that_keep_moving_writes_nothing(tmp_path) -> None:
    """Holds: pulls that come back at another version than Status said make the export try
    again, then refuse in one line (VersionChangedError), and no file is left behind."""
    out = tmp_path / "model.safetensors"
    with lying_server(
        Status=lambda r, c: job_status("j", [("w", (8,))], version=3),
        PullParams=lambda r, c: pull_reply(r, b"\0" * 32, version=4),
    ) as server:
        client = _client(server.address)
        try:
            with pytest.raises(VersionChangedError, match="Nothing was written"):
                tools.export(client, "j", out)
        finally:
            client.close()
        result = run_cli(["export", "j", "--out", str(out), "--servers", server.address])
    assert "Traceback" not in result.stderr and result.returncode == 1, result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("names", [["__metadata__"], ["a", "a"]], ids=["metadata", "twice"])
def test_export_writes_a_file_that_loads_or_nothing(names: list[str], tmp_path) -> None:
    """Parameter names come from Status as they are: one named ``__metadata__`` took the
    header's metadata key, one listed twice got one header entry and two tensors' bytes.
    Export said "1 tensors" (or 2) and exited 0, and safetensors could not load the file
    ("invalid JSON in header", "invalid offset for tensor `a`"). Refused, nothing written, now."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    out = tmp_path / "model.safetensors"
    with lying_server(
        Status=lambda r, c: job_status("j", [(n, (2,)) for n in names]),
        PullParams=lambda r, c: pull_reply(r, b"\0" * (4 * r.chunk.numel)),
    ) as server:
        client = _client(server.address)
        try:
            tools.export(client, "j", out)
        except RuntimeError as exc:  # refused: fine, if it names the parameter
            assert names[0] in str(exc)
            return
        finally:
            client.close()
    try:
        load_file(out)
    except SafetensorError as exc:
        pytest.fail(f"export wrote {out.name} and said nothing, but it does not load: {exc}")


# -- claims: sizes and counts a server only states -------------------------------------------


@pytest.mark.parametrize("shape", [(2**20, 2**20), (-2, 4)], ids=["4TiB", "negative"])
def test_claimed_shape_is_checked_before_it_is_allocated(shape: tuple[int, ...]) -> None:
    """A parameter's shape in Status was allocated as it was (``pull_param``'s
    ``np.empty``): 2**40 elements ended ``paramshard inspect`` in "MemoryError: Unable to
    allocate 4.00 TiB" (and reserved whatever fits on a host that overcommits), a negative
    dim in "ValueError: negative dimensions are not allowed". Checked against its buffer and
    the host's memory when Status is read now."""
    with lying_server(
        Status=lambda r, c: job_status("j", [("w", shape)], numel=8),
        PullParams=lambda r, c: pull_reply(r, b""),
    ) as server:
        result = run_cli(
            ["inspect", "j", "--servers", server.address], timeout=30, memory_limit=MEMORY_LIMIT
        )
    _one_line_error(result, server.address)


def test_part_numbers_in_job_names_are_not_enumerated() -> None:
    """Two jobs named ``m.pp0.tp0`` and ``m.pp0.tp400000000`` made ``paramshard inspect m``
    list every missing part of a 1 x 400,000,001 grid (``check_complete``): 35 GB of tuples,
    here a MemoryError at the 1 GiB limit after seconds of CPU; unlimited, the host's memory.
    The first 16 are named and the rest counted now."""
    jobs = [*job_status("m.pp0.tp0", [("w", (4,))]).jobs]
    jobs += job_status("m.pp0.tp400000000", [("w", (4,))]).jobs
    with lying_server(Status=lambda r, c: pb.StatusReply(jobs=jobs)) as server:
        try:
            result = run_cli(
                ["inspect", "m", "--servers", server.address],
                timeout=15,
                memory_limit=MEMORY_LIMIT,
            )
        except subprocess.TimeoutExpired:
            pytest.fail("paramshard inspect m ran past 15 s enumerating the parts a server named")
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 1 and len(result.stderr) < 10_000, result.stderr[-2000:]


def test_snapshot_listing_does_not_expand_a_server_count() -> None:
    """A SnapshotInfo of num_servers 2**32 - 1 and no placement was listed with
    ``servers: list(range(num_servers))`` (client/checkpoints.py ``list_snapshots``): 4 billion
    ints for a reply of 20 bytes, "MemoryError" from ``paramshard snapshots``. More than
    ``MAX_SERVERS`` is refused, naming the server, now."""
    info = pb.SnapshotInfo(job="j", tag="t", version=1, num_servers=2**32 - 1, created_unix=1.0)
    with lying_server(ListSnapshots=lambda r, c: pb.ListSnapshotsReply(snapshots=[info])) as server:
        result = run_cli(
            ["snapshots", "--servers", server.address], timeout=30, memory_limit=MEMORY_LIMIT
        )
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    if result.returncode != 0:
        assert server.address in result.stderr


def test_reply_larger_than_any_status_is_refused() -> None:
    """The client's channels took replies of any size (``grpc.max_receive_message_length``
    -1, client/cluster.py): a Status of 96 MiB (any string field) was received, parsed, turned
    into a dict and printed; protobuf's 2 GiB was the only bound. Past ``MAX_REPLY_BYTES``
    (128 MiB: twice the largest chunk) a reply is refused now."""
    device = "x" * (MAX_REPLY_BYTES + 2**20)
    with lying_server(Status=lambda r, c: pb.StatusReply(device=device)) as server:
        client = _client(server.address)
        try:
            (row,) = client.status()
        finally:
            client.close()
    assert "error" in row, f"took a Status reply of {len(row.get('device', '')):,} bytes"


def test_status_survives_times_that_are_not_numbers() -> None:
    """``uptime_seconds`` NaN ended ``paramshard status`` in "ValueError: cannot convert
    float NaN to integer", a pending row's ``age_seconds`` inf (with --pending) in
    "OverflowError: cannot convert float infinity to integer" (commands.human_duration, which
    shows "?" now)."""
    pending = pb.PendingWork(run="r", kind="all_reduce", key="r:ar0/0", age_seconds=float("inf"))
    reply = pb.StatusReply(uptime_seconds=float("nan"), pending=[pending])
    with lying_server(Status=lambda r, c: reply) as server:
        result = run_cli(["status", "--pending", "--servers", server.address], timeout=30)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]


# -- what the tools print --------------------------------------------------------------------


def _escaping(kind: str) -> dict[str, Any]:
    if kind == "inspect":
        status = job_status("j", [("w" + ESCAPES, (4,))])
        return {
            "Status": lambda r, c: status,
            "PullParams": lambda r, c: pull_reply(r, b"\0" * 16),
        }
    if kind == "snapshots":
        info = pb.SnapshotInfo(job="j", tag="t" + ESCAPES, version=1, num_servers=1)
        return {"ListSnapshots": lambda r, c: pb.ListSnapshotsReply(snapshots=[info])}

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.INTERNAL, "boom" + ESCAPES)

    return {"Status": refuse}


@pytest.mark.parametrize("kind", ["inspect", "snapshots", "error"])
def test_server_strings_reach_the_terminal_without_control_characters(kind: str) -> None:
    """Names, tags and error details from a server were printed as they came: a parameter, a
    snapshot tag or an error message carrying ESC and BEL sequences retitled, cleared and
    recoloured the user's terminal (and worse, on terminals that take OSC 52). The command
    line shows control characters as escapes now (paramshard/terminal.py)."""
    command = "snapshots" if kind == "snapshots" else "inspect"
    args = [command, *(["j"] if command == "inspect" else [])]
    with lying_server(**_escaping(kind)) as server:
        result = run_cli([*args, "--servers", server.address], timeout=30)
    printed = result.stdout + result.stderr
    assert "Traceback" not in printed, printed[-2000:]
    assert "\x1b" not in printed and "\x07" not in printed, repr(printed[-500:])


def test_a_calls_error_details_reach_the_caller_without_control_characters() -> None:
    """The command line escaped a server's error details, the library did not: a refusal
    carrying ESC and BEL sequences reached a trainer's traceback, its log and
    ``client.status()``'s rows as it came (gRPC bounds the details' length, not their
    characters). Every failed call's details pass through ``protos.words.details_of`` now."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused" + ESCAPES)

    with lying_server(Status=refuse, ListSnapshots=refuse) as server:
        client = _client(server.address)
        try:
            (row,) = client.status()
            with pytest.raises(ShardClientError) as raised:
                tools.list_snapshots(client)
        finally:
            client.close()
    for words in (row["error"], str(raised.value), raised.value.details):
        assert "refused" in words, words
        assert "\x1b" not in words and "\x07" not in words, repr(words)
    assert "\\x1b]0;owned\\x07" in raised.value.details, raised.value.details


# -- waits ------------------------------------------------------------------------------------


def test_status_of_a_server_that_never_answers_ends_at_its_deadline() -> None:
    """Holds: a Status that never answers ends ``paramshard status --timeout 1`` after about a
    second with an error row naming the server, exit 1."""

    def never(request: Any, context: grpc.ServicerContext) -> Any:
        until = time.monotonic() + 10
        while context.is_active() and time.monotonic() < until:
            time.sleep(0.05)
        context.abort(grpc.StatusCode.UNAVAILABLE, "too late")

    with lying_server(Status=never) as server:
        began = time.monotonic()
        result = run_cli(["status", "--timeout", "1", "--servers", server.address], timeout=30)
        took = time.monotonic() - began
    assert result.returncode == 1 and "DEADLINE_EXCEEDED" in result.stdout, result.stdout
    assert server.address in result.stdout and took < 8, took
