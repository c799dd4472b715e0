"""Sessions that no caller can turn against the server's memory or another caller's threads
(issue 27, findings 5 and 6; server/transport/sessions.py, server/rpc/admission.py).

Real in-process servers called through gRPC (``local_calls=False``), sessions driven by hand
(test_sessions.RawSession) so the hostile side does exactly what the finding did.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
from test_sessions import SESSION, RawSession, call, code_of, contribution, read

from paramshard.client import ClusterSpec, ShardClient, StepArgs
from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.transport import session_stream

pytestmark = pytest.mark.timeout(180)
TOKENS = {"tok-greedy": "train", "tok-other": "train"}


def rss() -> int:
    """This process's resident bytes (the in-process server's included)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def settled(server: ShardServer, quiet_s: float = 1.0, within: float = 60.0) -> int:
    """The bytes the server's sessions hold once the count stops moving for ``quiet_s``."""
    last, since = -1, time.monotonic()
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        now = server.sessions.held_bytes
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
        time.sleep(0.05)
    return last


class WideSession(RawSession):
    """A RawSession whose channel takes batches of any size (a batch of replies may pass
    4 MiB by its last reply, as the client's channels allow: client/cluster.py)."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.channel = grpc.insecure_channel(address, [("grpc.max_receive_message_length", -1)])
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        stub = self.channel.stream_stream(SESSION)
        self.call = stub(iter(self.out.get, None), metadata=metadata, timeout=60)


# -- finding 5: a session's replies are counted before they exist ------------------------------
@pytest.mark.parametrize("future", [True, False], ids=["future-version", "current-version"])
def test_a_batch_of_pulls_nobody_reads_is_bounded_before_it_runs(monkeypatch, future) -> None:
    """Before: one session sent pulls of a 1 MiB slice in one batch and read nothing; the
    server took as many as its waiting bound let in, and built every reply once the version
    came (the bound on unsent replies counted a reply only once it existed: 64 MiB here past
    a bound of 8; pulls of the current version overshot as far as the pool ran ahead of the
    replies, 430-770 MB past 256 MB with 4 MiB pulls in the finding). Now a pull counts the
    bytes its reply may carry when it is taken, and past the bound it is refused "retry
    later" at once, with nothing held for it."""
    bound = 8 * 2**20
    monkeypatch.setattr(session_stream, "MAX_UNSENT_BYTES", bound)
    numel, pulls = 2**18, 256  # 1 MiB replies
    with ShardServer(local_calls=False) as server:
        c = ShardClient(ClusterSpec([server.address]), timeout_s=10, sessions=False)
        try:
            values = np.arange(numel, dtype=np.float32)
            c.register_buffer("j", "w", numel, optimizer="sgd", hyper={"lr": 0.5})
            c.set_params("j", "w", values)
            body = pb.PullParamsRequest(
                ref=pb.BufferRef(job="j", buffer="w"),
                chunk=pb.Chunk(offset=0, numel=numel, dtype=pb.FLOAT32),
                min_version=int(future),  # 1: they wait for the step below, then all reply
            ).SerializeToString()
            before = rss()
            s = WideSession(server.address)
            try:
                s.opened()
                s.send(*[call(i, "PullParams", body, 60) for i in range(pulls)])
                settled(server, quiet_s=0.5)
                grad = np.ones(numel, np.float32)
                c.push_grads("j", "w", grad, 0, step_args=StepArgs(hyper={"lr": 0.5}))
                expected = values - 0.5 if future else values
                held = settled(server)
                grown = rss() - before
                # the bound, one reply past it, and what gRPC's windows hold of sent batches
                assert held <= bound + 2 * values.nbytes, f"{held:,} bytes of replies held"
                assert grown < 48 * 2**20, f"the server grew by {grown:,} bytes"
                got = s.replies(pulls)  # once read, every pull is answered
                answered = {i for i, r in got.items() if r.code == 0}
                busy = {
                    i for i, r in got.items() if code_of(r) == grpc.StatusCode.RESOURCE_EXHAUSTED
                }
                assert answered | busy == set(range(pulls)) and answered, got[0].details
                if future:  # every pull was taken or refused before any reply existed
                    assert len(answered) * values.nbytes <= bound
                else:  # a few more: replies gRPC took into its windows count as sent
                    assert len(answered) <= pulls // 8, len(answered)
                assert all("retry later" in got[i].details for i in busy)
                _, data = codec.decode(got[min(answered)].body, pb.PullParamsHeader)
                np.testing.assert_array_equal(np.frombuffer(data, np.float32), expected)
            finally:
                s.close()
        finally:
            c.close()
        assert settled(server, quiet_s=0.2) == 0


# -- finding 6: calls that wait never hold the threads another caller's collective needs -------
def push_body(numel: int) -> bytes:
    header = pb.PushGradHeader(
        ref=pb.BufferRef(job="stuck", buffer="w"),
        chunk=pb.Chunk(offset=0, numel=numel, dtype=pb.FLOAT32),
        step=0,
        num_micro=1,
    )
    return codec.encode(header, np.ones(numel, np.float32))


def test_pushes_waiting_for_initial_values_leave_others_collectives_alone() -> None:
    """Before: a train token's session sent 256 PushGrads to a buffer never initialised; they
    waited for its initial values on the sessions' threads without counting as waiting, and
    two other ranks' all-reduce failed with RESOURCE_EXHAUSTED "256 calls are running". Now
    such a push counts as waiting (the session's and the gate's bounds), and one token's
    waiting calls hold at most half the waiting threads, its second session included."""
    with ShardServer(local_calls=False, tokens=TOKENS) as server:
        spec = ClusterSpec([server.address])
        spec.token = "tok-greedy"
        c = ShardClient(spec, timeout_s=10, sessions=False)
        greedy = [WideSession(server.address, "tok-greedy") for _ in range(2)]
        try:
            c.register_buffer("stuck", "w", 16)  # never SetParams: pushes wait for it
            for s in greedy:
                s.opened()
                s.send(*[call(i, "PushGrad", push_body(16), 30) for i in range(256)])
            busy, since = -1, time.monotonic()
            while time.monotonic() - since < 0.5:  # both sessions have taken their calls
                if server.gate.busy != busy:
                    busy, since = server.gate.busy, time.monotonic()
                time.sleep(0.02)
            other = ClusterSpec([server.address])
            other.token = "tok-other"
            ranks = [
                ShardClient(other, rank=r, world_size=2, run_id="others", timeout_s=5.0)
                for r in range(2)
            ]
            try:
                with ThreadPoolExecutor(2) as pool:
                    out = list(
                        pool.map(
                            lambda rank: rank.all_reduce(
                                np.full(1000, rank.rank + 1.0, np.float32)
                            ),
                            ranks,
                        )
                    )
            finally:
                for rank in ranks:
                    rank.close()
            for got in out:
                np.testing.assert_array_equal(got, np.full(1000, 3.0, np.float32))
            # the greedy token: half the waiting threads at most, the rest refused at once
            assert server.gate.waiting_of("tok-greedy") == server.gate.caller_bound
            for s in greedy:
                for reply in s.replies(1).values():
                    assert code_of(reply) == grpc.StatusCode.RESOURCE_EXHAUSTED, reply.details
                    assert "retry later" in reply.details
        finally:
            for s in greedy:
                s.close()
            c.close()


# -- found in review: a session cancelled as it opens -----------------------------------------
def test_a_session_cancelled_as_it_opens_is_forgotten_with_its_bytes() -> None:
    """A session whose client cancels it before the server sent its opening batch: gRPC then
    closes the server's side at that first reply, and the session's end ran only after it.
    Before, such sessions stayed among the server's for good, with their calls' replies and
    bytes (in review: 102 of 300 sessions of 16 reads each kept; a read token's pulls grew a
    server by 2.8 GB in 30 s, and once their bytes passed the sessions' bound every session
    was held to a share of it). Now every one ends, its bytes with it."""
    values = np.ones(1024, np.float32)
    with ShardServer(local_calls=False) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = channel.stream_stream(SESSION)
            for i in range(60):  # cancelled at 0-3 ms: some before the opening batch
                out: queue.SimpleQueue[Any] = queue.SimpleQueue()
                calls = []
                for j in range(16):
                    key = f"r:open{i}_{j}/0"
                    calls.append(call(2 * j, "Contribute", contribution(key, values)))
                    calls.append(call(2 * j + 1, "ReadSlot", read(key)))
                out.put(pb.SessionBatch(calls=calls).SerializeToString())
                stream = stub(iter(out.get, None), timeout=30)
                time.sleep(0.001 * (i % 4))
                stream.cancel()
                out.put(None)
        deadline = time.monotonic() + 30
        while (server.sessions.open or server.sessions.held_bytes) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.sessions.open == 0
        assert server.sessions.held_bytes == 0
