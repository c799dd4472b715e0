"""A training process against a server that lies (a compromised host of the cluster, a server
of another version, a buggy peer).

tests/test_lying_server.py probed the job tools; these drive the training side: the real
strategies and client against a lying server (tests/lying_servers.py) or a proxy of a real
server whose one reply lies (tests/lying_training.py). Whatever it sends, a trainer must not
train on values that are not what it asked for, must keep its memory and CPU bounded by what it
asked, and must fail with a ShardClientError that names the server. Each test but the one that
says "Held" failed on the code before its fix (docs/security.md, nineteenth round).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from lying_servers import lying_server
from lying_training import lying_proxy
from torch import nn

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client import session as sessions
from paramshard.client.membership import Membership
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.strategies import DATA_PARALLEL, ShardingConfiguration


@pytest.fixture(name="real", scope="module")
def real_fixture() -> Any:
    """One honest in-process server behind the proxies."""
    server = ShardServer("127.0.0.1", 0).start()
    yield server.address
    server.stop(0)


def _client(address: str, **kw: Any) -> ShardClient:
    kw.setdefault("sessions", False)
    kw.setdefault("timeout_s", 3)
    return ShardClient(ClusterSpec([address]), retries=1, shared_memory=False, **kw)


# -- pulls: a reply at another version than asked -------------------------------------------


def test_pull_below_min_version_is_data_loss_not_stale_weights(real: str) -> None:
    """A ZeRO-1 step pulls its parameters at ``min_version`` = the step just taken; a
    server that answers every pull with its first reply (version 0, the initial weights, said
    so in its header) was taken: three SGD steps left the model at its initial weights, no
    error (client/buffers.py ``pull_calls``' ``store`` never compares the header's version
    with ``min_version``). Such a reply cannot be: DATA_LOSS naming the server."""
    first: dict[tuple[int, str], bytes] = {}

    def stale_pull(raw: bytes, forward: Any) -> bytes:
        request = pb.PullParamsRequest.FromString(raw)
        reply = forward(raw)
        return first.setdefault((request.chunk.offset, request.state), reply)

    torch.manual_seed(0)
    module = nn.Linear(4, 2)
    initial = module.weight.detach().clone()
    with lying_proxy(real, PullParams=stale_pull) as proxy:
        client = _client(proxy.address)
        try:
            config = ShardingConfiguration(client, job=f"z{uuid.uuid4().hex[:8]}", timeout_s=3)
            model_cls, opt_cls = DATA_PARALLEL["zero1"]
            model = model_cls(module, config)
            opt = opt_cls(torch.optim.SGD(module.parameters(), lr=0.1), config)
            with pytest.raises(ShardClientError, match="DATA_LOSS") as caught:
                for _ in range(3):
                    model(torch.ones(3, 4)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                pytest.fail(
                    "three steps trained on a stale pull; weights unchanged:"
                    f" {torch.equal(module.weight.detach(), initial)}"
                )
            assert proxy.address in str(caught.value)
        finally:
            client.close()


# -- sessions: what a server's stream may hold -----------------------------------------------


def test_session_batch_of_calls_never_made_is_not_parsed_whole(
    real: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session's replies are decoded with no bound on their number
    (client/session.py: ``response_deserializer=decode_batch``, no ``limit``): a server that
    sent one batch of 1,000,000 empty replies (2 MB, naming calls never made) cost the client
    810 MB of memory and 3.3 s of CPU on its receiver thread, and a SetParams sent meanwhile
    ran out its deadline; within the 128 MiB a reply may have, 64 million replies (~50 GB).
    A batch holds at most the calls in flight; more is refused before it is parsed."""
    n = 100_000
    largest: list[int] = [0]
    decode = sessions.decode_batch

    def counted(raw: Any, *args: Any, **kw: Any) -> Any:
        calls = decode(raw, *args, **kw)
        largest[0] = max(largest[0], len(calls))
        return calls

    monkeypatch.setattr(sessions, "decode_batch", counted)

    def flood(requests: Any, forward: Any) -> Any:
        for i, batch in enumerate(forward(requests)):
            yield batch
            if i == 0:  # the open batch, then replies to no call of the client's
                yield b"\x0a\x00" * n

    with lying_proxy(real, Session=flood) as proxy:
        client = _client(proxy.address, sessions=True)
        try:
            job = f"s{uuid.uuid4().hex[:8]}"
            client.register_buffer(job, "b", 8)
            try:
                client.set_params(job, "b", np.ones(8, np.float32))
            except ShardClientError as exc:  # refusing the session is fine; naming the server
                assert proxy.address in str(exc)
        finally:
            client.close()
    assert largest[0] <= 4096, f"a session batch of {largest[0]:,} replies was parsed whole"


def _open_then(answer: Any) -> Any:
    """A Session handler: the open batch, then ``answer(call)`` for each call that comes."""

    def session(requests: Any, context: grpc.ServicerContext) -> Any:
        yield pb.SessionBatch()
        for batch in requests:
            yield pb.SessionBatch(calls=[answer(call) for call in batch.calls])

    return session


def test_session_error_details_are_bounded() -> None:
    """A session reply's error ``details`` are taken whole (client/session.py
    ``SessionFuture.resolve``; ``ShardClientError`` in client/rpc.py): gRPC bounds a unary
    call's status details by its metadata limit (16 KiB), but a session's reply carried 20 MB
    of them and a trainer's SetParams raised an error of 20 MB (the last line of its
    traceback, its log line). Cut to a bound, as a status's details are."""
    huge = "x" * (20 << 20)
    code = grpc.StatusCode.FAILED_PRECONDITION.value[0]

    def refuse(call: pb.SessionCall) -> pb.SessionCall:
        return pb.SessionCall(id=call.id, code=code, details=huge)

    with lying_server(Session=_open_then(refuse)) as server:
        client = _client(server.address, sessions=True)
        try:
            with pytest.raises(ShardClientError) as caught:
                client.set_params("j", "b", np.ones(8, np.float32))
        finally:
            client.close()
    message = str(caught.value)
    assert server.address in message
    assert len(message) <= 1 << 20, f"an error of {len(message):,} characters"


def test_session_duplicates_and_strangers_are_ignored_and_silence_ends_at_the_deadline() -> None:
    """Held: Replies twice over, and replies naming calls never made (ids 0 and 2**64 - 1),
    leave a SetParams its one reply; a session that opens and never answers fails the call
    at its deadline (plus the session's grace), naming the server: no hang."""

    def twice(call: pb.SessionCall) -> list[pb.SessionCall]:
        return [pb.SessionCall(id=i) for i in (call.id, call.id, 0, 2**64 - 1)]

    def chatty(requests: Any, context: grpc.ServicerContext) -> Any:
        yield pb.SessionBatch()
        for batch in requests:
            yield pb.SessionBatch(calls=[x for call in batch.calls for x in twice(call)])

    def silent(requests: Any, context: grpc.ServicerContext) -> Any:
        yield pb.SessionBatch()
        for _ in requests:
            pass

    with lying_server(Session=chatty) as server:
        client = _client(server.address, sessions=True)
        try:
            client.set_params("j", "b", np.ones(8, np.float32))
        finally:
            client.close()
    with lying_server(Session=silent) as server:
        client = _client(server.address, sessions=True, timeout_s=1)
        began = time.monotonic()
        try:
            with pytest.raises(ShardClientError, match="DEADLINE_EXCEEDED") as caught:
                client.set_params("j", "b", np.ones(8, np.float32))
        finally:
            client.close()
        assert time.monotonic() - began < 8.0
    assert server.address in str(caught.value)


# -- the hang doctor: a server's account of a wait that timed out ----------------------------


def test_timed_out_pull_error_bounds_the_servers_pending_rows() -> None:
    """A call that times out asks the server's Status (``pending``, at most 200 rows)
    and puts its rows in the error (client/hang_report.py ``_server_says``/``_words``): the
    rows' number and each row's rank lists are taken as sent, so 500 rows of 2,000 missing
    ranks made a PullParams' error of 5.5 MB (2,000 rows: 22 MB). The rows asked for, a few
    ranks each (the rest counted), are what the error may hold."""

    def never(request: Any, context: grpc.ServicerContext) -> Any:
        time.sleep(min(3.0, context.time_remaining() or 3.0) + 0.2)
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "late")

    rows = [
        pb.PendingWork(run="j", kind="push_grad", seq=i, key="j/b", missing=range(2000))
        for i in range(500)
    ]
    with lying_server(PullParams=never, Status=lambda r, c: pb.StatusReply(pending=rows)) as server:
        client = ShardClient(
            ClusterSpec([server.address]), timeout_s=1, retries=1, shared_memory=False,
            sessions=False,
        )  # fmt: skip
        try:
            with pytest.raises(ShardClientError) as caught:
                client.pull_params("j", "b", 8, min_version=1)
        finally:
            client.close()
    message = str(caught.value)
    assert server.address in message
    assert len(message) <= 1 << 16, f"an error of {len(message):,} characters"


# -- elastic membership: the coordinator's word on who trains a step -------------------------

_JOINS = {
    "members_outside_the_world": dict(members=[7], leader=7),
    "this_rank_not_listed": dict(members=[1], leader=1),
    "no_members": dict(members=[]),
    "duplicates": dict(members=[0, 0, 0], leader=0),
    "step_before_asked": dict(members=[0, 1], leader=0, step=0),
}


@pytest.mark.parametrize("case", sorted(_JOINS))
def test_join_reply_that_cannot_be_is_refused(case: str) -> None:
    """``Membership.join`` (client/membership.py) returns whatever members a decided
    Join reply lists: ranks outside the world (7 of 2), a list without this rank though it
    says "member" (then ``part`` fails with "tuple.index(x): x not in tuple", naming no
    server), duplicates (rank 0 of members [0, 0, 0] trains on 3 of 8 rows, and the push
    says 3 members to every server), or step 0 when step 3 was asked. Each is DATA_LOSS
    naming the coordinator."""
    reply = pb.JoinReply(**{"decided": True, "member": True, "step": 3, **_JOINS[case]})
    with lying_server(Join=lambda r, c: reply, Lease=lambda r, c: pb.LeaseReply()) as server:
        client = ShardClient(
            ClusterSpec([server.address]), rank=0, world_size=2, run_id="lying-join",
            timeout_s=3, retries=1, shared_memory=False,
        )  # fmt: skip
        try:
            membership = Membership(client, "j", min_members=1, window_s=1, wait_s=3)
            with pytest.raises(ShardClientError, match="DATA_LOSS") as caught:
                got = membership.join(3)
                pytest.fail(f"joined step {got.step} with members {got.members[:8]}")
            assert server.address in str(caught.value)
        finally:
            client.close()


# -- leases: a server's notice reaches the trainer's log and errors ---------------------------

ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[31m"
"""An OSC title change, a screen clear and a colour (tests/test_lying_server.py)."""


def test_lease_notice_escapes_do_not_reach_the_trainers_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A lease's abort notice is the server's words, logged as they came
    (client/run_state.py ``RunState.abort``: ``log.warning("%s", notice.reason)``) and put in
    every refused call's error (``Notice.ended_call``): a notice carrying ESC and BEL sequences
    retitled, cleared and recoloured the terminal of every rank it reached, as the tools'
    output did before round 19 (#162). Written as escapes, as ``paramshard`` writes them."""

    def notice(request: Any, context: grpc.ServicerContext) -> pb.LeaseReply:
        return pb.LeaseReply(aborted=f"run aborted {ESCAPES}", aborted_epoch=0, lost_rank=1)

    def hold(request: Any, context: grpc.ServicerContext) -> Any:
        yield notice(request, context)
        time.sleep(1.0)

    caplog.set_level("WARNING")
    with lying_server(Lease=notice, HoldLease=hold) as server:
        client = ShardClient(
            ClusterSpec([server.address]), rank=0, world_size=2, run_id="lying-notice",
            timeout_s=3, retries=1, shared_memory=False,
        )  # fmt: skip
        try:
            with pytest.raises(ShardClientError, match="ABORTED") as caught:
                client.pull_params("j", "b", 8, min_version=1)
        finally:
            client.close()
    said = [r.getMessage() for r in caplog.records] + [str(caught.value)]
    raw = [line for line in said if "\x1b" in line or "\x07" in line]
    assert not raw, f"the server's escapes, raw: {raw[0]!r}"
