"""Hostile calls on the collective slots (Contribute, ReadSlot, ContributeRead), Session streams,
shared segments and pipeline mailboxes, from every role and two teams' scoped tokens, over real
gRPC on 127.0.0.1 (helpers: tests/slot_probes.py). The first tests are findings: each asserts
what the server should do and failed on the code it was found in; the rest are probes that held.
After each call: no INTERNAL or UNKNOWN, a message that says what was wrong."""

from __future__ import annotations

import sys
import time

import grpc
import numpy as np
import pytest
from replica_probes import call, refused
from slot_probes import (
    PULL_B,
    Background,
    Code,
    RawSession,
    cancelled_reads,
    churn_freed_keys,
    contribution,
    freed_chunk_growth,
    header,
    packed_ids,
    raw_call,
    read,
    session_call,
    settled,
    slot_keys,
    team_b_job,
    team_server,
    timed_call,
    values,
    waiting_contribute_reads,
    worst_latency,
)

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def server(servers) -> ShardServer:
    return team_server(servers)


# ----------------------------------------------------------------------------------- findings
def test_a_waiting_read_of_a_slot_claiming_huge_chunks_holds_back_no_other_team(server) -> None:
    """A slot's chunk size is what its first contribution's header says, backed by nothing: a
    one-element contribution at the last offset (or one of no element with ``total_numel``
    0) may claim chunks of 2**40 elements. A unary ReadSlot of such a slot's chunk 0 then
    counts 4 TiB of reply bytes it may carry (call_peeks.reply_bytes -> chunk_nbytes) in
    the server's unsent-reply total, and "a caller with nothing held always gets one call
    through": while team A's read waits (up to --max-wait-s, and again), every reply-carrying
    unary call of every other team was refused RESOURCE_EXHAUSTED ("replies of
    4,398,046,511,104 bytes wait to be sent (read) ... retry later"), team B's PullParams of
    its own 16-byte slice included. A chunk larger than a message can never arrive whole:
    such a contribution may be refused, saying so; either way team B's pull goes through."""
    team_b_job(server.address)
    big = 2**40
    h = header("team-a-r:x", expected=2, op=pb.SUM, numel=1, total_numel=big + 1,
               chunk_numel=big, chunk=pb.Chunk(offset=big, numel=1, dtype=pb.FLOAT32))  # fmt: skip
    got = call(server.address, "Contribute", contribution(h), "a")
    if isinstance(got, grpc.RpcError):
        assert got.code() == Code.INVALID_ARGUMENT and "in a message" in got.details(), got
    waiting = Background(
        lambda: timed_call(server.address, "ReadSlot", read("team-a-r:x"), "a", timeout=6)
    )
    time.sleep(1.0)
    try:
        out = call(server.address, "PullParams", PULL_B, "b")
    finally:
        waiting.result()
    assert isinstance(out, pb.PullParamsReply), out.details()


def test_a_contribution_that_disagrees_about_arrival_order_loses_no_other(server) -> None:
    """``check_same`` compares op, counts, shape and dtype with the slot's first
    contribution, not ``arrival_order``, and each contribution is added by its own header's
    order. Contributor 2 (rank order) came first and was staged; contributor 1 saying
    ``arrival_order`` became the accumulator; contributor 0 was added and moved the head to
    1, which was never staged, so contributor 2's values were never added: all three counted,
    the read answered OK with 1 + 10 = 11 where the sum is 111. Three ShardClients whose rank 1
    has ``deterministic = False`` got 11 from all_reduce on every rank the same way. The
    disagreeing contribution must be refused, or the sum must hold every contribution."""
    key = "team-a-r:ar1/0"

    def send(contributor: int, value: float, arrival: bool) -> object:
        h = header(key, contributor, expected=3, op=pb.SUM, arrival_order=arrival)
        return call(server.address, "Contribute", contribution(h, [value] * 4), "a")

    assert isinstance(send(2, 100.0, False), pb.ContributeReply)
    odd = send(1, 10.0, True)
    assert isinstance(send(0, 1.0, False), pb.ContributeReply)
    if isinstance(odd, grpc.RpcError):
        assert odd.code() == Code.FAILED_PRECONDITION, odd.details()
        assert "arrival_order" in odd.details()
        assert isinstance(send(1, 10.0, False), pb.ContributeReply)
    assert values(call(server.address, "ReadSlot", read(key), "a")) == [111.0] * 4
    # the same through ShardClients: rank 1's with deterministic=False, ranks 2, 1, 0 in turn
    clients = [ShardClient(ClusterSpec([server.address], token="a"), r, 3, run_id="team-a-m",
                           timeout_s=10) for r in range(3)]  # fmt: skip
    clients[1].deterministic = False

    def reduce(c: ShardClient) -> object:
        try:
            return c.all_reduce(np.full(4, 10.0**c.rank, np.float32)).tolist()
        except ShardClientError as exc:  # refused: it must say why
            return "arrival_order" in str(exc) or str(exc)

    try:
        sums = []
        for c in clients[::-1]:
            sums.append(Background(lambda c=c: reduce(c)))
            time.sleep(0.3)
        assert all(b.result() in ([111.0] * 4, True) for b in sums), [b.result() for b in sums]
    finally:
        for c in clients:
            c.close()


def test_a_read_tokens_release_list_does_not_stall_the_server(server) -> None:
    """ReleaseSegments (role read, any scope) parses its ``repeated uint64 segments`` whole,
    then builds ``set(req.segments)`` holding the GIL: a packed list of one-byte ids is 8
    bytes an id in protobuf and more as Python ints. From a read token scoped to team A, a
    64 MiB request took 2.9 s while an unscoped reader's Status waited 2.7 s behind it (the
    process's peak +640 MB); 255 MiB (the server takes 256 MiB) took 18.8 s, Status waited
    17.8 s, and the process peaked at 5.25 GB from 64 MB, outside --max-memory. A caller
    holds at most 128 segments: such a list should be refused or walked at once, and other
    callers' calls go on meanwhile."""
    big = Background(
        lambda: timed_call(server.address, "ReleaseSegments", packed_ids(64 * 2**20), "a-read")
    )
    worst = worst_latency(server.address, big)
    out, took = big.result()
    assert took < 1.0, f"ReleaseSegments of 64M ids held a thread {took:.1f} s"
    assert worst < 1.0, f"another caller's Status waited {worst:.1f} s"
    if isinstance(out, grpc.RpcError):
        assert out.code() in (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED), out.details()


def test_a_cancelled_read_of_a_slot_nobody_opened_leaves_no_slot(server) -> None:
    """A ReadSlot that waits out its deadline on a key nobody contributed to forgets the empty
    slot it opened (``_forget_if_unused``); one whose caller went away ends CANCELLED from
    ``callers.check`` inside the wait, past that cleanup: 20 such reads (a trainer killed
    mid-read, a channel closed) left 20 empty slots, 82,380 bytes of the token's slot share,
    listed by Status as pending work "no contribution has arrived", until --pending-ttl
    (600 s); a session closed with 60 reads waiting left 56 (the 4 in line left none)."""
    cancelled_reads(server.address, "a", [f"team-a-r:gone{i}" for i in range(10)])
    with RawSession(server.address, "a") as s:  # and in a session that closes (56 left)
        s.send([session_call(i + 1, "ReadSlot", read(f"team-a-r:s{i}").SerializeToString(), 60)
                for i in range(10)])  # fmt: skip
        time.sleep(1.0)
    assert settled(lambda: server.gate.busy == 0)
    assert settled(lambda: server.servicer.slots.usage() == (0, 0)), slot_keys(server)


def test_a_slots_freed_chunks_and_readers_are_paid_for() -> None:
    """A slot remembers every chunk offset freed (``Slot.freed``) and every reader of a chunk
    (``Chunk.readers``) until it is forgotten, uncharged. A slot claiming 2**62 one-element
    chunks is never forgotten, nor a chunk expecting 2**32 - 1 readers freed: each
    Contribute and ReadSlot pair, or each read by a new reader number, kept about 70 bytes the
    account never saw (50,000 pairs: +3.5 MB traced, 4,116 bytes charged), for as long as
    the caller keeps the slot busy (each call touches it, so it never expires)."""
    grown, held = freed_chunk_growth(10_000)
    assert grown <= held + 256 * 2**10, (grown, held)


def test_another_teams_keys_do_not_push_a_freed_key_out_of_the_servers_memory(server) -> None:
    """The keys read by all their readers and freed are remembered in one book for every team
    (65,536 keys, 48 MiB: gone_keys.py), so that a late retry is acknowledged, not taken for a
    new slot. Team A's session sent 20,400 Contribute + ReadSlot pairs of ~1 KB keys of its
    own run in 4.0 s, which pushed team B's freed message out of the book: team B's retried
    Contribute of it (its reply lost) then answered duplicate=False and opened a ghost slot
    (5,042 bytes of team B's slot share, listed as pending until --pending-ttl), and a
    retried read would wait out its deadline. One team's keys should not evict another's."""
    key = "team-b-r:p2p0-1/1"
    sent = contribution(header(key))
    assert isinstance(call(server.address, "Contribute", sent, "b"), pb.ContributeReply)
    assert values(call(server.address, "ReadSlot", read(key), "b")) == [1.0] * 4
    churn_freed_keys(server.address, "a", "team-a-r")
    again = call(server.address, "Contribute", sent, "b")
    assert isinstance(again, pb.ContributeReply) and again.duplicate, again
    assert slot_keys(server) == []


def test_one_teams_contribute_reads_take_half_of_the_unsent_reply_bound_at_most(server) -> None:
    """Unary replies not yet sent have a bound (1 GiB) and half of it per token
    (unsent_replies.py), but the gate names the caller only for the waiting methods, and a
    ContributeRead is not one: its reply bytes were counted as nobody's (caller None), with no
    share. Four waiting ContributeReads of team A, their 256 MiB payloads in its own shared
    segments (pages never touched: RSS +1 MB), held all 1,073,741,824 bytes, and team B's
    PullParams of 16 bytes got RESOURCE_EXHAUSTED "retry later" while they waited."""
    team_b_job(server.address)
    with waiting_contribute_reads(server.address, "a", 4, 2**28):
        out = call(server.address, "PullParams", PULL_B, "b")
    assert isinstance(out, pb.PullParamsReply), out.details()


@pytest.mark.parametrize(
    "key",
    ["team-a-r:ar99999999999999999999/0", "team-a-r:ag1/4294967296", "team-a-r:p2p4294967296-1/1"],
)
def test_a_slot_keys_numbers_break_no_status(server, key: str) -> None:
    """``slot_row`` copies the numbers of a slot key (sequence, part, a message's ranks) into
    ``PendingWork``'s uint64 and uint32 fields unchecked: one open slot of team A's run whose
    key says sequence 10**20 - 1, part 2**32 or sender 2**32 (a contribution, or just a
    waiting ReadSlot) made every Status --pending of the server's unscoped tokens and of
    team A's reader end INTERNAL ("ValueError: Value out of range"), until the slot went
    (--pending-ttl, 600 s). Team B's scoped Status, which lists none of it, held."""
    h = header(key, readers=2)
    assert isinstance(call(server.address, "Contribute", contribution(h), "a"), pb.ContributeReply)
    for token in ("reader-secret", "admin-secret", "a-read"):
        status = call(server.address, "Status", pb.StatusRequest(pending=True), token)
        assert isinstance(status, pb.StatusReply) and [p.key for p in status.pending] == [key]


# ---------------------------------------------------------------------------- probes that held
def test_a_read_token_contributes_and_reads_no_slot_unary_or_in_a_session(server) -> None:
    """Read tokens (scoped and unscoped) calling Contribute, ReadSlot and ContributeRead on a
    key of their own scope, unary and in a session: PERMISSION_DENIED naming the role, and no
    slot opened."""
    h = header("team-a-r:p2p0-1/1")
    for token in ("a-read", "reader-secret"):
        for method, req in (
            ("Contribute", contribution(h)),
            ("ContributeRead", contribution(header("team-a-r:ar1/0", op=pb.SUM, expected=2))),
            ("ReadSlot", read("team-a-r:p2p0-1/1")),
        ):
            assert "role" in refused(server.address, method, req, Code.PERMISSION_DENIED, token)
        with RawSession(server.address, token) as s:
            s.send([
                session_call(1, "Contribute", (h, np.ones(4, np.float32))),
                session_call(2, "ReadSlot", read("team-a-r:p2p0-1/1").SerializeToString()),
                session_call(3, "ContributeRead", (h, np.ones(4, np.float32))),
            ])  # fmt: skip
            got = s.take(3)
        assert sorted(c.id for c, _ in got) == [1, 2, 3]
        assert all(c.code == Code.PERMISSION_DENIED.value[0] for c, _ in got), got
    assert slot_keys(server) == []


def test_a_team_reaches_no_other_teams_slot_through_a_second_header(server) -> None:
    """A Contribute whose bytes hold two headers (team B's key, then team A's; and the other
    way round) or a key in a second header alone, unary and in a session: the key protobuf
    keeps (the last) decides, the parsed request is checked again, and no slot of team B's
    run opens."""
    one = np.ones(4, np.float32).tobytes()
    hb = pb.ContributeRequest(header=header("team-b-r:p2p0-1/1")).SerializeToString()
    ha = pb.ContributeRequest(header=header("team-a-r:p2p0-1/1")).SerializeToString()
    data = pb.ContributeRequest(data=one).SerializeToString()
    key_b = pb.ContributeRequest(header=pb.SlotHeader(key="team-b-r:x")).SerializeToString()
    out, _ = timed_call(server.address, "Contribute", ha + hb + data, "a")
    assert out.code() == Code.PERMISSION_DENIED and "team-b-r" in out.details()
    out, _ = timed_call(server.address, "Contribute", ha + key_b + data, "a")
    assert out.code() == Code.PERMISSION_DENIED and "team-b-r" in out.details()
    with RawSession(server.address, "a") as s:
        s.send([session_call(1, "Contribute", ha + hb + data), session_call(2, "Contribute", hb)])
        got = s.take(2)
    assert {c.id: c.code for c, _ in got} == {1: Code.PERMISSION_DENIED.value[0]} | {
        2: Code.PERMISSION_DENIED.value[0]
    }
    out, _ = timed_call(server.address, "Contribute", hb + ha + data, "a")
    assert isinstance(out, pb.ContributeReply)  # team A's own key, the last one
    assert slot_keys(server) == ["team-a-r:p2p0-1/1"]


@pytest.mark.parametrize(
    "raw, code",
    [
        (raw_call(b"\x12\x03\xff\xfe\xfd"), Code.INVALID_ARGUMENT),  # method not UTF-8
        (b"".join(raw_call(b"\x08\x01") for _ in range(1025)), Code.RESOURCE_EXHAUSTED),
        (b"\xff\xff\xff\xff", Code.INVALID_ARGUMENT),
        (raw_call(b"\x0b\x0c"), Code.INVALID_ARGUMENT),  # a group
    ],
)
def test_a_malformed_batch_ends_its_session_saying_why(server, raw: bytes, code: Code) -> None:
    """Batches that do not parse, or hold more than 1,024 calls, end the session with a short
    reason; nothing is left open. A call naming a method of 100,000 characters is answered
    UNIMPLEMENTED quoting 64 of them, and the session goes on."""
    with RawSession(server.address, "a") as s:
        s.send_raw(raw)
        err = s.ended()
    assert err is not None and err.code() == code and len(err.details()) < 300, err
    with RawSession(server.address, "a") as s:
        s.send_raw(raw_call(b"\x08\x07\x12" + b"\xa0\x8d\x06" + b"M" * 100_000))
        ((got, _),) = s.take(1)
    assert got.id == 7 and got.code == Code.UNIMPLEMENTED.value[0] and len(got.details) < 300
    assert settled(lambda: server.sessions.open == 0)
    assert slot_keys(server) == []


def test_slot_calls_use_only_their_own_tokens_segments(server) -> None:
    """Team A's Contribute naming team B's confirmed segment, or a read token's, as its
    payload: FAILED_PRECONDITION, nothing read; team A releasing team B's segment releases
    none. A ContributeRead whose payload its segment holds, released while the call waits,
    still counts what it sent (the mapping lingers until the call lets go)."""
    from shm_probes import Segment

    mine, theirs, readers = (Segment(server.address, t, 4096) for t in ("a", "b", "a-read"))
    try:
        for seg in (theirs, readers):
            h = header("team-a-r:p2p0-1/1", shm=seg.ref(16))
            refused(server.address, "Contribute", pb.ContributeRequest(header=h),
                    Code.FAILED_PRECONDITION, "a")  # fmt: skip
        release = pb.ReleaseSegmentsRequest(segments=[theirs.id, readers.id])
        assert call(server.address, "ReleaseSegments", release, "a").released == 0
        mine.map[0:16] = np.full(4, 5.0, np.float32).tobytes()
        key = "team-a-r:ar1/0"
        h0 = header(key, 0, expected=2, readers=2, op=pb.SUM, shm=mine.ref(16))
        holder = Background(lambda: call(server.address, "ContributeRead",
                                         pb.ContributeRequest(header=h0), "a"))  # fmt: skip
        time.sleep(0.5)
        release = pb.ReleaseSegmentsRequest(segments=[mine.id])
        assert call(server.address, "ReleaseSegments", release, "a").released == 1
        server.servicer.segments.expire()
        h1 = header(key, 1, expected=2, readers=2, op=pb.SUM)
        assert values(call(server.address, "ContributeRead", contribution(h1), "a")) == [6.0] * 4
        assert values(holder.result()) == [6.0] * 4
    finally:
        server.servicer.segments.expire()
        for seg in (theirs, readers):
            seg.close()
    assert slot_keys(server) == []


def test_a_teams_mailbox_is_out_of_the_other_teams_reach(server) -> None:
    """Team A's unread pipeline message: team B's train token reading it, writing over it,
    or dropping its run, and a read token of team A reading it: refused; team B's Status
    lists no pending work of it; team A's receiver then reads it intact."""
    key = "team-a-r:p2p0-1.act/1"
    sent = contribution(header(key, shape=[2, 2]), [1.0, 2.0, 3.0, 4.0])
    assert isinstance(call(server.address, "Contribute", sent, "a"), pb.ContributeReply)
    refused(server.address, "ReadSlot", read(key, 1), Code.PERMISSION_DENIED, "b")
    refused(server.address, "ReadSlot", read(key, 1), Code.PERMISSION_DENIED, "a-read")
    refused(server.address, "Contribute", contribution(header(key)), Code.PERMISSION_DENIED, "b")
    drop = pb.DropJobRequest(job="team-a-r")
    refused(server.address, "DropJob", drop, Code.PERMISSION_DENIED, "b")
    status = call(server.address, "Status", pb.StatusRequest(pending=True), "b")
    assert [p.key for p in status.pending] == []
    status = call(server.address, "Status", pb.StatusRequest(pending=True), "a-read")
    assert [(p.key, p.kind) for p in status.pending] == [(key, "send")]
    got = call(server.address, "ReadSlot", read(key, 1), "a")
    assert values(got) == [1.0, 2.0, 3.0, 4.0] and list(got.header.shape) == [2, 2]
    assert not got.header.HasField("shm") and got.header.contributor == 0


def test_contribute_reads_racing_drop_job_leave_nothing_behind(server) -> None:
    """Three ranks' ContributeReads of 1.2 MB chunks (they may wait for their turn) racing
    DropJob and Status --pending of their run for 8 s, with a 10 us switch interval: no
    INTERNAL or UNKNOWN (``timed_call`` asserts it), every completed sum right, and the
    slots, the account and the gate's counts back to nothing."""
    end, n = time.monotonic() + 8, 300_000

    def rank(r: int) -> list[object]:
        seen, seq = [], 0
        while time.monotonic() < end:
            seq += 1
            h = header(f"team-a-r:ar{seq}/0", r, expected=3, readers=3, op=pb.SUM, numel=n)
            req = contribution(h, np.full(n, r + 1, np.float32))
            out, _ = timed_call(server.address, "ContributeRead", req, "a", timeout=3)
            seen.append(out if isinstance(out, grpc.RpcError) else set(values(out)))
        return seen

    def drops() -> int:
        count = 0
        while time.monotonic() < end:
            timed_call(server.address, "DropJob", pb.DropJobRequest(job="team-a-r"), "a-admin")
            timed_call(server.address, "Status", pb.StatusRequest(pending=True), "a-admin")
            count += 1
            time.sleep(0.02)
        return count

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        ranks = [Background(lambda r=r: rank(r)) for r in range(3)]
        dropper = Background(drops)
        outs = [o for b in ranks for o in b.result()]
        assert dropper.result() > 0
    finally:
        sys.setswitchinterval(before)
    sums = [o for o in outs if isinstance(o, set)]
    assert sums and all(o == {6.0} for o in sums), [o for o in sums if o != {6.0}][:3]
    codes = {o.code() for o in outs if isinstance(o, grpc.RpcError)}
    assert codes <= {Code.ABORTED, Code.DEADLINE_EXCEEDED, Code.NOT_FOUND}, codes
    assert settled(lambda: server.gate.busy == 0 and server.servicer.slots.turns.waiting == 0)
    server.servicer.slots.ttl_s = 0
    server.servicer.slots.expire()
    assert server.servicer.slots.usage() == (0, 0)
    assert server.servicer.budget.usage()["slots"] == 0
