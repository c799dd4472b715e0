"""Releases a closed client did not see answered, sent again by the process's next client of the
run (client/lease_releases.py): which ones, where, and who waits. The calls are stand-ins that
record what was sent and answer when the test says; tests/test_run_ids.py runs the same on real
servers that hold back every first release."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import grpc
import pytest

from paramshard.client import lease_releases
from paramshard.protos import shard_pb2 as pb


class _Call(Future):
    """A gRPC call's future: a wait that ends first raises grpc.FutureTimeoutError."""

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        except TimeoutError:
            raise grpc.FutureTimeoutError() from None


class _Client:
    """What ``send_again`` uses of a client: its addresses and a ``Lease`` stub whose calls
    answer at once, or when ``gate`` is set."""

    def __init__(self, addresses: list[str], gate: threading.Event | None = None) -> None:
        self.spec = self
        self.addresses = addresses
        self.sent: list[tuple[str, int, int]] = []  # (address, rank, client)
        self.gate = gate

    def metadata(self) -> list[tuple[str, str]]:
        return []

    def stub(self, server: int, method: str) -> Any:
        assert method == "Lease"
        client = self

        class Stub:
            def future(self, request: pb.LeaseRequest, timeout: float, metadata: Any) -> Future:
                client.sent.append((client.addresses[server], request.rank, request.client))
                fut: Future = _Call()
                if client.gate is None:
                    fut.set_result(pb.LeaseReply(lost_rank=-1))
                else:
                    threading.Thread(target=_answer_at, args=(client.gate, fut)).start()
                return fut

        return Stub()


def _answer_at(gate: threading.Event, fut: Future) -> None:
    gate.wait(10)
    fut.set_result(pb.LeaseReply(lost_rank=-1))


def _unanswered(run: str, rank: int, client: int, addresses: list[str]) -> None:
    """A closed client's release of ``rank`` that the servers at ``addresses`` did not answer."""
    request = pb.LeaseRequest(run=run, rank=rank, world_size=2, release=True, client=client)
    never: Future = _Call()  # a call that never came back
    sent = [(i, never) for i in range(len(addresses))]
    lease_releases.await_release(_Client(addresses), request, sent)


@pytest.fixture(autouse=True)
def _short_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lease_releases.closing, "STEP_S", 0.001)  # a call never answered


def test_the_next_client_sends_every_rank_release_of_its_run_to_the_servers_it_has() -> None:
    _unanswered("a", 0, client=1, addresses=["s0", "s1"])
    _unanswered("a", 1, client=2, addresses=["s1"])
    _unanswered("b", 0, client=3, addresses=["s0"])  # another run: kept for its own next client
    nxt = _Client(["s1", "s2"])
    lease_releases.send_again(nxt, "a")
    assert sorted(nxt.sent) == [("s1", 0, 1), ("s1", 1, 2)]
    lease_releases.send_again(nxt, "a")  # sent once: answered now, or given up
    assert len(nxt.sent) == 2
    other = _Client(["s0"])
    lease_releases.send_again(other, "b")
    assert other.sent == [("s0", 0, 3)]


def test_a_client_that_comes_while_another_sends_waits_for_the_answers() -> None:
    _unanswered("w", 0, client=1, addresses=["s0"])
    _unanswered("w", 1, client=2, addresses=["s0"])
    gate = threading.Event()
    first, second = _Client(["s0"], gate), _Client(["s0"])
    sender = threading.Thread(target=lease_releases.send_again, args=(first, "w"))
    sender.start()
    while len(first.sent) < 2:
        time.sleep(0.01)
    waiter = threading.Thread(target=lease_releases.send_again, args=(second, "w"))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not second.sent  # waits; sends nothing of its own
    gate.set()
    sender.join(10)
    waiter.join(10)
    assert not waiter.is_alive() and not second.sent


def test_answered_releases_are_not_kept_and_the_kept_ones_stay_bounded() -> None:
    request = pb.LeaseRequest(run="k", rank=0, world_size=2, release=True, client=9)
    done: Future = _Call()
    done.set_result(pb.LeaseReply(lost_rank=-1))
    lease_releases.await_release(_Client(["s0"]), request, [(0, done)])
    nxt = _Client(["s0"])
    lease_releases.send_again(nxt, "k")
    assert not nxt.sent
    for rank in range(lease_releases.KEPT + 5):  # the oldest five go
        _unanswered("many", rank, client=rank + 1, addresses=["s0"])
    nxt = _Client(["s0"])
    lease_releases.send_again(nxt, "many")
    assert sorted(r for _, r, _ in nxt.sent) == list(range(5, lease_releases.KEPT + 5))
