"""The sessions' line of waiting calls (server/transport/waiting_line.py) against a real
admission gate: which call runs when a place frees, and what one that leaves frees."""

from __future__ import annotations

import grpc

from paramshard.server.rpc.admission import CallGate, CallLimits
from paramshard.server.transport.session_calls import SessionJob
from paramshard.server.transport.waiting_line import InLine, WaitingLine


class Session:
    """What the line reads of a session: its token, whether its stream ended, the calls it
    was told ended and the replies it was given."""

    def __init__(self, caller: str | None = None) -> None:
        self.caller, self.stopped, self.ended = caller, False, []
        self.replies: list[tuple[int, int, str]] = []  # call id, status code, details

    def call_ended(self, waits: str | None, received: int = 0) -> None:
        self.ended.append((waits, received))

    def put(self, counted: int, reply: tuple, size: int = 0, promised: int = 0) -> None:
        self.replies.append((reply[0].id, reply[0].code, reply[0].details))


def entry(session: Session, call_id: int) -> InLine:
    job = SessionJob(call_id, "ReadSlot", None, None, None, None, "train", 10, 0)
    return InLine(session, job)


def line_of(workers: int, reserved: int) -> tuple[CallGate, WaitingLine, list[int]]:
    gate = CallGate(CallLimits(workers=workers, reserved=reserved))
    started: list[int] = []
    return gate, WaitingLine(gate, lambda e: started.append(e.job.call_id)), started


def test_a_call_that_does_not_wait_frees_a_place_for_the_line() -> None:
    """The gate's bound on threads counts every call in a handler. Two calls that do not wait
    fill the two places a waiting call may take; a read goes in line; when they leave, the read
    runs. Before, only a waiting call's leaving woke the line, and a read there stayed until one
    did: an all-reduce of 300 ranks stood for 54 s."""
    gate, line, started = line_of(workers=4, reserved=2)
    assert gate.enter(None) is None and gate.enter(None) is None  # two pushes running
    s = Session()
    assert line.enter(entry(s, 1)) is False and len(line) == 1
    gate.leave(None)
    assert started == [1] and len(line) == 0 and line.admitted_later == 1
    assert gate.busy == 2 and gate.waiting["train"] == 1  # the read holds its place now


def test_a_tokens_calls_run_in_order_and_others_go_by() -> None:
    """One token past its bound (half the waiting places) waits in line, first come first
    run; another token's call finds a place meanwhile; a call of a session that ended is
    dropped from the line with its counts given back."""
    gate, line, started = line_of(workers=6, reserved=2)  # 4 waiting places, 2 a token
    a, b = Session("tok-a"), Session("tok-b")
    assert [line.enter(entry(a, i)) for i in range(5)] == [True, True, False, False, False]
    assert line.enter(entry(b, 10)) is True  # not behind tok-a's line
    a_ended = Session("tok-a")
    a_ended.stopped = True
    line.enter(entry(a_ended, 99))
    gate.leave("train", "tok-a")
    assert started == [2]
    gate.leave("train", "tok-a")
    gate.leave("train", "tok-a")
    assert started == [2, 3, 4] and len(line) == 0  # the ended one was dropped, not run
    assert a_ended.ended == [("train", 10)]
    assert gate.waiting_of("tok-a") == 2 and gate.waiting_of("tok-b") == 1


def test_callers_lines_take_freed_places_in_turn() -> None:
    """Two tokens under their own bounds wait only for places: each place that frees goes to
    the next token's line in turn, not to the first line until its token's bound."""
    gate, line, started = line_of(workers=10, reserved=2)  # 8 waiting places, 4 a token
    a, b = Session("tok-a"), Session("tok-b")
    assert line.enter(entry(a, 0)) is True and line.enter(entry(b, 10)) is True
    for _ in range(6):
        assert gate.enter(None) is None  # calls that do not wait fill the other places
    for i in (1, 2, 3):
        assert line.enter(entry(a, i)) is False and line.enter(entry(b, 10 + i)) is False
    for _ in range(4):
        gate.leave(None)
    assert started == [1, 11, 2, 12]


def test_a_stopping_server_answers_its_line_and_starts_none_of_it() -> None:
    """``Sessions.drain`` stops the line: each call in it is answered UNAVAILABLE (it never
    ran: its client sends it again) and its counts given back; a place that frees starts
    none, and a call taken as the server began to stop is answered the same. Before, the
    places freed when a stopping server ended its waits started calls from the line, each in
    a new wait that held the process's exit up to its deadline (120 s at most)."""
    gate, line, started = line_of(workers=3, reserved=2)  # one place for a waiting call
    s = Session("tok-a")
    assert line.enter(entry(s, 1)) is True  # runs
    assert line.enter(entry(s, 2)) is False and line.enter(entry(s, 3)) is False
    line.stop("this server is stopping")
    unavailable = grpc.StatusCode.UNAVAILABLE.value[0]
    assert len(line) == 0 and s.ended == [("train", 10), ("train", 10)]
    assert s.replies == [(i, unavailable, "this server is stopping") for i in (2, 3)]
    gate.leave("train", "tok-a")  # call 1 ends: its place starts nothing
    assert started == [] and line.admitted_later == 0
    assert line.enter(entry(s, 4)) is False
    assert started == [] and [r[0] for r in s.replies] == [2, 3, 4] and len(line) == 0
