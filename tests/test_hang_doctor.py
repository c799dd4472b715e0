"""Issue 13, finding 11 (the hang doctor) and two follow-ups of findings 8 and 4.

- A collective one rank never reaches: the timed-out error names the missing rank, the run and
  the sequence number; ``paramshard status --pending`` lists it on the server it waits on,
  with who arrived, who is missing, who waits to read it and for how long, beside gradient
  steps waiting for a rank and mailbox messages nobody took.
- Status reports the server's memory account (used and limit), and ``paramshard status``
  shows it.
- A unary call a busy server refused ("retry later", server/rpc/admission.py) is retried until a
  thread frees or its deadline passes; a memory-limit refusal is final. (A session's call waits
  in the server's line instead: test_sessions_bounds.py.)

Every test runs over real gRPC (``local_calls=False``).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from paramshard import cli, commands
from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.client.rpc import Call, RpcCore
from paramshard.protos import shard_pb2 as pb
from paramshard.server.buffers.slice_state import SLICE_RECORD_BYTES, buffer_bytes
from paramshard.server.collectives import pending as hang_doctor
from paramshard.server.collectives.pending import slot_row
from paramshard.server.optimizers import OPTIMIZERS

N = 64


def make_client(addresses: list[str], rank: int = 0, world: int = 1, **kw: Any) -> ShardClient:
    kw.setdefault("timeout_s", 20.0)
    return ShardClient(ClusterSpec(addresses), rank=rank, world_size=world, **kw)


def settle(condition: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return found


def in_threads(*fns: Callable[[], Any]) -> tuple[list[threading.Thread], list[Any]]:
    """Starts each ``fn`` in a thread; the second list gets each one's result or exception."""
    outcomes: list[Any] = [None] * len(fns)

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            outcomes[i] = fn()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    return threads, outcomes


def pending(c: ShardClient, server: int = 0, **kw: Any) -> list[dict[str, Any]]:
    return c.status(pending=True, **kw)[server].get("pending", [])


# --- a timed-out collective names who is missing -------------------------------------------------
def test_a_timed_out_collective_names_the_missing_rank_the_run_and_the_sequence(servers) -> None:
    addresses = [s.address for s in servers(2, local_calls=False)]
    clients = [make_client(addresses, r, 3, run_id="train-7", timeout_s=1.5) for r in range(3)]
    try:
        threads, outcomes = in_threads(
            *[lambda c=c: c.all_reduce(np.ones(N, np.float32)) for c in clients]
        )
        for t in threads:
            t.join()
        assert all(isinstance(o, np.ndarray) for o in outcomes), outcomes  # #1 completes
        threads, outcomes = in_threads(  # rank 2 never reaches all-reduce #2
            *[lambda c=c: c.all_reduce(np.ones(N, np.float32)) for c in clients[:2]]
        )
        for t in threads:
            t.join()
    finally:
        for c in clients:
            c.close()
    for err in outcomes:
        assert isinstance(err, ShardClientError), err
        assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED  # the server's, with its message
        assert "all_reduce #2 of run 'train-7'" in err.details, err.details
        assert "2 of 3 contributions arrived; missing rank(s) 2 (arrived: 0, 1)" in err.details


def test_a_message_never_sent_names_its_sender(servers) -> None:
    (server,) = servers(1, local_calls=False)
    c = make_client([server.address], rank=0, world=2, run_id="pp", timeout_s=0.8)
    try:
        with pytest.raises(ShardClientError) as err:
            c.recv(1, tag="act")
    finally:
        c.close()
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    details = err.value.details
    assert "message #1 from rank 1 to rank 0 tagged 'act' of run 'pp'" in details, details
    assert "rank 1 has not sent it" in details


# --- paramshard status --pending ---------------------------------------------------------------
def test_status_pending_shows_open_collectives_steps_and_unread_messages(
    servers, capsys: pytest.CaptureFixture
) -> None:
    addresses = [s.address for s in servers(2, local_calls=False)]
    ranks = [make_client(addresses, r, 3, run_id="hang") for r in range(3)]
    admin = make_client(addresses)
    try:
        ranks[0].send(np.arange(5, dtype=np.float32), dst=1, tag="act")  # nobody takes it
        ranks[0].register_buffer("job", "w", 8, contributors=2)
        ranks[0].set_params("job", "w", np.zeros(8, np.float32))
        ranks[0].push_grads("job", "w", np.ones(8, np.float32), step=0)  # rank 1 never pushes
        began = time.monotonic()
        threads, outcomes = in_threads(  # rank 2 is late for all-reduce #1
            *[lambda c=c: c.all_reduce(np.ones(N, np.float32)) for c in ranks[:2]]
        )

        def waiting() -> dict[str, Any] | None:
            rows = [p for s in (0, 1) for p in pending(admin, s) if p["kind"] == "all_reduce"]
            return rows[0] if rows and len(rows[0]["waiting"]) == 2 else None

        row = settle(waiting, "ranks 0 and 1 to wait in all-reduce #1")
        assert (row["run"], row["seq"], row["key"]) == ("hang", "1", "hang:ar1/1")
        assert (row["expected"], row["arrived"], row["missing"]) == (3, [0, 1], [2])
        assert row["waiting"] == [0, 1] and row["unread_by"] == []
        time.sleep(0.3)
        assert cli.main(["status", "--servers", ",".join(addresses), "--pending"]) == 0
        shown = time.monotonic()
        out = capsys.readouterr().out

        # all-reduce #1 waits on server 1 (a small tensor goes to server seq mod 2)
        line = next(x for x in out.splitlines() if "hang:ar1/1" in x)
        cells = re.split(r"\s{2,}", line.strip())
        assert cells[:8] == ["hang", "all_reduce", "1", "1", "0-1", "2", "0-1", "-"], cells
        age = float(cells[8].rstrip("s"))  # opened after ``began``, before ``seen``; to 0.1 s
        assert shown - began + 0.05 >= age >= 0.3

        line = next(x for x in out.splitlines() if "job/w" in x)
        cells = re.split(r"\s{2,}", line.strip())
        assert cells[:6] == ["job", "push_grad", "0", "-", "0", "1"], cells

        assert "Unread messages:" in out
        line = next(x for x in out.splitlines() if "hang:p2p0-1.act/1" in x)
        cells = re.split(r"\s{2,}", line.strip())
        assert cells[:6] == ["hang", "0", "1", "act", "1", "20 B"], cells

        # rank 2 arrives: the collective completes and leaves the list
        ranks[2].all_reduce(np.ones(N, np.float32))
        for t in threads:
            t.join()
        assert all(isinstance(o, np.ndarray) for o in outcomes), outcomes
        kinds = sorted(p["kind"] for s in (0, 1) for p in pending(admin, s))
        assert kinds == ["push_grad", "push_grad", "send"]  # the step waits on both servers
    finally:
        for c in [*ranks, admin]:
            c.close()


def test_the_pending_list_is_bounded_and_says_how_many_it_left_out(servers, monkeypatch) -> None:
    """The oldest open slots are listed, and rows are made for them only: a Status made a row
    for each of the server's slots before it cut the list (150,000 slots: 4.7 s, in review)."""
    made = []
    monkeypatch.setattr(hang_doctor, "slot_row", lambda *a: made.append(1) or slot_row(*a))
    (server,) = servers(1, local_calls=False)
    c = make_client([server.address], run_id="many")
    try:
        for k in range(5):
            header = pb.SlotHeader(
                key=f"many:ar{k + 1}/0",
                op=pb.SUM,
                expected=2,
                readers=2,
                total_numel=4,
                chunk_numel=4,
                chunk=pb.Chunk(offset=0, numel=4, dtype=pb.FLOAT32),
            )
            c.call(0, "Contribute", (header, np.ones(4, np.float32)))
        (row,) = c.status(pending=True, max_pending=2)
        assert [p["seq"] for p in row["pending"]] == ["1", "2"]  # the oldest first
        assert row["pending_left_out"] == 3 and len(made) == 2
        (row,) = c.status(pending=True, max_pending=10**6)  # capped by the server
        assert len(row["pending"]) == 5 and row["pending_left_out"] == 0
        (row,) = c.status()  # without --pending the reply stays small
        assert row["pending"] == [] and row["open_slots"] == 5
    finally:
        c.close()


# --- memory in Status ---------------------------------------------------------------------------
def test_status_reports_the_memory_account(servers, capsys: pytest.CaptureFixture) -> None:
    (server,) = servers(1, local_calls=False, max_memory="64MiB")
    c = make_client([server.address])
    try:
        (before,) = c.status()
        c.register_buffer("job", "w", 1000, optimizer="adam")
        (after,) = c.status()
    finally:
        c.close()
    assert int(before["memory_limit"]) == int(after["memory_limit"]) == 64 * 2**20
    assert int(before["memory_used"]) == 0
    # every state array, and the slice's record
    reserved = buffer_bytes(1000, 4, len(OPTIMIZERS["adam"].state_names)) + SLICE_RECORD_BYTES
    assert int(after["memory_used"]) == server.servicer.budget.used == reserved
    assert cli.main(["status", "--servers", server.address]) == 0
    header, line = capsys.readouterr().out.splitlines()
    cells = dict(zip(re.split(r"\s{2,}", header), re.split(r"\s{2,}", line), strict=True))
    assert cells["MEMORY"] == f"{commands.human_bytes(reserved)} / 64.0 MiB"


# --- retry when busy, not when out of memory ---------------------------------------------------
def counting_sends(client: RpcCore, method: str) -> list[float]:
    """Records when ``client`` sends a ``method`` call."""
    sent: list[float] = []
    send = client._send

    def counted(call: Call, *a: Any, **kw: Any) -> Any:
        if call.method == method:
            sent.append(time.monotonic())
        return send(call, *a, **kw)

    client._send = counted  # type: ignore[method-assign]
    return sent


def read_request(key: str, reader: int) -> pb.ReadSlotRequest:
    return pb.ReadSlotRequest(key=key, offset=0, reader=reader)


def set_slot(key: str) -> tuple[pb.SlotHeader, np.ndarray]:
    header = pb.SlotHeader(
        key=key,
        op=pb.SET,
        expected=1,
        readers=2,
        total_numel=4,
        chunk_numel=4,
        chunk=pb.Chunk(offset=0, numel=4, dtype=pb.FLOAT32),
    )
    return header, np.arange(4, dtype=np.float32)


def test_a_busy_server_is_asked_again_until_a_thread_frees(servers) -> None:
    # 2 workers, 1 kept for calls that do not wait: one waiting call at a time
    (server,) = servers(1, local_calls=False, max_workers=2, reserved_workers=1)
    unary = {"sessions": False}  # only unary calls are refused busy
    first, second = make_client([server.address], **unary), make_client([server.address], **unary)
    try:
        threads, outcomes = in_threads(lambda: first.call(0, "ReadSlot", read_request("k", 0)))
        settle(lambda: server.gate.busy == 1, "the first read to wait")
        sent = counting_sends(second, "ReadSlot")
        threads2, outcomes2 = in_threads(lambda: second.call(0, "ReadSlot", read_request("k", 1)))
        settle(lambda: len(sent) >= 3, "the second read to be refused and retried")
        first.call(0, "Contribute", set_slot("k"))  # never refused; completes the slot
        for t in threads + threads2:
            t.join()
    finally:
        first.close()
        second.close()
    for _, data in (outcomes[0], outcomes2[0]):
        np.testing.assert_array_equal(np.frombuffer(data, np.float32), np.arange(4))


def test_busy_retries_end_at_the_deadline(servers) -> None:
    (server,) = servers(1, local_calls=False, max_workers=2, reserved_workers=1)
    first = make_client([server.address], timeout_s=10.0, sessions=False)
    second = make_client([server.address], timeout_s=1.0, sessions=False)  # unary: refused busy
    try:
        threads, _ = in_threads(lambda: first.call(0, "ReadSlot", read_request("k", 0)))
        settle(lambda: server.gate.busy == 1, "the first read to wait")
        sent = counting_sends(second, "ReadSlot")
        began = time.monotonic()
        with pytest.raises(ShardClientError) as err:
            second.call(0, "ReadSlot", read_request("k", 1))
        took = time.monotonic() - began
        first.call(0, "Contribute", set_slot("k"))
        for t in threads:
            t.join()
    finally:
        first.close()
        second.close()
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry later" in err.value.details
    assert len(sent) >= 3 and took <= 1.0 + 0.5  # within its deadline, plus one round trip


def test_a_memory_limit_refusal_is_not_retried(servers) -> None:
    (server,) = servers(1, local_calls=False, max_memory="4KiB")
    c = make_client([server.address], timeout_s=10.0)
    try:
        sent = counting_sends(c, "ContributeRead")
        with pytest.raises(ShardClientError) as err:
            c.all_reduce(np.ones(4096, np.float32))  # 16 KiB in a slot
    finally:
        c.close()
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "memory limit of 4,096 bytes" in err.value.details
    assert len(sent) == 1
