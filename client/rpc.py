"""Calls to many servers at once: one stub per server, many calls in flight, retries, deadlines.

docs/design.md §7.5: several concurrent calls beat sequential ones by 25-40%, and 4-16 MiB messages
move fastest, so every tensor is cut into ``chunk_bytes`` pieces and up to ``max_in_flight`` of
them travel at once. Requests are built lazily, so a large tensor is never encoded all at once.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc

from paramshard.client import hang_report, leases, restarts, slow_waits, unreachable
from paramshard.client.call_order import Batch
from paramshard.client.chunk_size import chunk_bytes_for
from paramshard.client.cluster import ClusterSpec
from paramshard.client.futures import UNUSABLE, Done, ShmFuture, used_reply
from paramshard.client.local_calls import HEADER_ROOM, LocalFuture, LocalRpcError, local_call
from paramshard.client.retries import (
    MIN_ATTEMPT_S,
    RETRYABLE,
    busy_pause,
    freed_slot,
    is_busy,
    retry_pause,
)
from paramshard.client.run_state import WAITS_ON_PEERS, RunState
from paramshard.client.session import MAX_BODY, Sessions
from paramshard.protos import closing, codec, local_servers
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.batches import SESSION_METHODS, TENSOR_REPLIES
from paramshard.protos.ended_ranks import says_ended
from paramshard.protos.service import method_path
from paramshard.protos.shm import SharedMemory, is_stale
from paramshard.protos.words import details_of

__all__ = [
    "ShardClientError", "Call", "RpcCore", "MAX_IN_FLIGHT", "DEFAULT_TIMEOUT_S", "unusable_reply"
]  # fmt: skip

MAX_IN_FLIGHT = 8  # the default number of calls a client keeps in flight
DEFAULT_TIMEOUT_S = 120.0
"""A client's deadline of every wait unless it is given one (``timeout_s``; a
ShardingConfiguration's ``timeout_s`` sets it)."""


class ShardClientError(RuntimeError):
    """A call failed: names the server, the method, the gRPC code and the server's message."""

    def __init__(self, server: int, address: str, method: str, code: grpc.StatusCode, details: str):
        super().__init__(f"server {server} ({address}) {method}: {code.name}: {details}")
        self.server, self.address, self.method = server, address, method
        self.code, self.details = code, details


def unusable_reply(core: Any, server: int, method: str, why: str) -> ShardClientError:
    """The error of a call whose reply says what cannot be (a lying or broken server)."""
    address = core.spec.addresses[server]
    return ShardClientError(
        server, address, method, grpc.StatusCode.DATA_LOSS, f"{UNUSABLE}: {why}"
    )


_TENSOR_HEADERS = {
    "PullParams": pb.PullParamsHeader,
    "ReadSlot": pb.SlotHeader,
    "ContributeRead": pb.SlotHeader,
}
# method -> its reply's deserializer, from the service in the proto (the request side always
# uses codec.serialize); a tensor reply is read as (header, payload view) by protos/codec.py
_METHODS: dict[str, Callable[[bytes], Any]] = {
    m.name: codec.deserializer(_TENSOR_HEADERS[m.name])
    if m.name in _TENSOR_HEADERS
    else getattr(pb, m.output_type.name).FromString
    for m in pb.DESCRIPTOR.services_by_name["Shard"].methods
}
assert set(_TENSOR_HEADERS) == set(TENSOR_REPLIES), "a tensor reply without its header"


_MAY_WAIT = frozenset({"PullParams", "ReadSlot", "ContributeRead", "GradNorm", "Step"})
"""Calls that may wait for other ranks: sent as futures even alone, so a notice cancels them."""


@dataclass
class Call:
    """One RPC to one server. ``request`` is a message, a (header, payload) tuple, or a
    zero-argument function building either (so payloads are encoded only when sent).
    ``on_result`` runs with the reply as soon as it arrives."""

    server: int
    method: str
    request: Any
    on_result: Callable[[Any], None] | None = None
    retry_ok: Callable[[ShardClientError], bool] | None = None  # a failure a retry may accept
    device_reply: bool = False
    """A PullParams whose caller takes the values as a device array (DLPack) when the server
    is in this process on that device (``RpcCore.local_device``); bytes otherwise."""
    reply_bytes: int = 0
    """The reply's payload size, when the caller knows it (a slot read of a known chunk):
    a large reply in-band goes as its own call, not in a session."""


class RpcCore:
    """Owns the stubs; runs batches of calls concurrently with retries."""

    def __init__(
        self,
        spec: ClusterSpec,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = 5,
        max_in_flight: int = MAX_IN_FLIGHT,
        chunk_bytes: int | None = None,
        shared_memory: bool | None = None,
        sessions: bool | None = None,
    ) -> None:
        chunk_bytes = chunk_bytes_for(chunk_bytes, spec.servers_per_host)
        self.spec = spec
        spec.hold()  # released by close(): other clients of the spec keep its channels
        self._holds_spec = True
        self.timeout_s = timeout_s
        self.wait_notice_s = slow_waits.notice_s()  # a long wait on peers says so meanwhile
        self.retries = retries
        self.max_in_flight = max_in_flight
        self.chunk_bytes = chunk_bytes
        self._stubs: dict[tuple[str, str], Any] = {}  # (address, method): groups share them
        self._lock = threading.Lock()
        # in-process calls not finished yet: closing the client cancels them, as closing a
        # channel cancels its gRPC calls (a rank waiting on a dead peer's slot then ends)
        self._local_calls: weakref.WeakSet[LocalFuture] = weakref.WeakSet()
        self.closed = False  # once close() ran: the lease's streams and renewals stop
        self.run_state = RunState()  # epoch, abort notice, calls in flight (client/leases.py)
        # payloads to servers on this host (protos/shm.py)
        self.shm = SharedMemory(chunk_bytes, max_in_flight, shared_memory)
        self.sessions = Sessions(sessions)  # one stream per server for the data plane

    @property
    def num_servers(self) -> int:
        return len(self.spec)

    def stub(self, server: int, method: str) -> Any:
        """The unary stub of ``method`` on server ``server``, made once (views share it)."""
        key = (self.spec.addresses[server], method)
        with self._lock:
            if key not in self._stubs:
                self._stubs[key] = self.spec.channel(server).unary_unary(
                    method_path(method),
                    request_serializer=codec.serialize,
                    response_deserializer=_METHODS[method],
                )
            return self._stubs[key]

    def _may_call_locally(self) -> bool:
        """In-process calls carry no credentials: only a client without tokens or TLS makes
        them (to servers that have neither)."""
        return not self.spec.metadata() and self.spec.tls_ca is None

    def local_device(self, server: int, nbytes: int = 0) -> str | None:
        """The device of server ``server``'s arrays ("cpu", "cuda:N") when it runs in this
        process and this client calls it directly with a payload of ``nbytes``, else None: a
        payload already on that device goes to it through DLPack (protos/local_servers.py).
        A payload past the server's receive limit goes through gRPC, as bytes."""
        if not self._may_call_locally():
            return None
        local = local_servers.lookup(self.spec.addresses[server])
        if local is None or nbytes + HEADER_ROOM > local.max_receive_bytes:
            return None
        return local.device

    def _send(self, call: Call, alone: bool = False, timeout: float | None = None) -> Any:
        """Starts ``call`` with deadline ``timeout`` (default ``timeout_s``); returns a future.
        ``alone`` (the only call of its batch): run it to completion here instead, with
        grpcio's blocking path. That path waits on its own completion queue, while every
        future on an idle channel makes grpcio start (and then end) a polling thread: for one
        call that thread costs more than the call."""
        timeout = self.timeout_s if timeout is None else timeout
        peers = call.method in WAITS_ON_PEERS
        if peers and (notice := self.run_state.current()) is not None:
            return Done(error=LocalRpcError(grpc.StatusCode.ABORTED, notice.ended_call(sent=False)))
        request = call.request() if callable(call.request) else call.request
        if self._may_call_locally():
            address = self.spec.addresses[call.server]
            local = local_call(call.method, call.device_reply, address, request, timeout)
            if local is not None:
                with self._lock:
                    self._local_calls.add(local)
                if self.closed:
                    local.cancel()
                if peers:
                    self.run_state.track(local)
                return local
        request, seg = self.shm.attach(self, call.server, call.method, request)
        future = self._in_session(call, request, timeout)
        if future is None:
            future = self._unary(call, request, timeout, alone)
        if peers and not isinstance(future, Done):  # a notice cancels it (client/leases.py)
            self.run_state.track(future)
        return future if seg is None else ShmFuture(future, self.shm, seg)

    def _in_session(self, call: Call, request: Any, timeout: float) -> Any:
        """``call`` sent in its server's session (client/session.py), or None."""
        if call.method not in SESSION_METHODS:
            return None
        if isinstance(request, tuple):
            size = request[0].ByteSize() + codec.byte_view(request[1]).nbytes
        else:
            size = request.ByteSize()
        asked = request[0] if call.method == "ContributeRead" else request
        if call.method in TENSOR_REPLIES and not asked.HasField("reply_shm"):
            if call.method == "PullParams":
                itemsize = codec.numpy_dtype(request.chunk.dtype).itemsize
                size += request.chunk.numel * itemsize
            else:
                size += call.reply_bytes
        if size > MAX_BODY:
            return None  # its own call: a session costs large payloads more (docs/design.md §7.3)
        session = self.sessions.get(self, call.server)
        if session is None:
            return None
        body = codec.serialize(request)
        return session.submit(call.method, body, _METHODS[call.method], timeout)

    def _room(self, server: int) -> bool:
        """Whether a batch with calls in flight to server ``server`` may send one more
        (client/call_order.py): to a server of this process, always (no segments). The window
        (``max_in_flight``) is ``run``'s to keep."""
        address = self.spec.addresses[server]
        if self._may_call_locally() and local_servers.lookup(address) is not None:
            return True
        return self.shm.has_room(address)

    def _unary(self, call: Call, request: Any, timeout: float, alone: bool) -> Any:
        stub = self.stub(call.server, call.method)
        if alone and call.method not in _MAY_WAIT:
            try:
                future = Done(stub(request, timeout=timeout, metadata=self.spec.metadata()))
            except grpc.RpcError as exc:
                future = Done(error=exc)
        else:
            future = stub.future(request, timeout=timeout, metadata=self.spec.metadata())
        return future

    def plain_call(self, server: int, method: str, request: Any, timeout: float) -> Any:
        """One call through gRPC, no retries (grpc.RpcError on failure)."""
        stub = self.stub(server, method)
        return stub(request, timeout=timeout, metadata=self.spec.metadata())

    def _error(self, call: Call, exc: grpc.RpcError) -> ShardClientError:
        address = self.spec.addresses[call.server]
        code, details = exc.code(), details_of(exc)
        return ShardClientError(
            call.server, address, call.method, code, unreachable.explain(address, code, details)
        )

    def _final(
        self, call: Call, err: ShardClientError, attempts: int, began: float
    ) -> ShardClientError:
        """The error a call ends with: after retries, how many and for how long; a wait on
        other ranks that timed out without the server's account of it (grpc's bare "Deadline
        Exceeded": the server's reply came too late), that account from the server's Status
        (client/hang_report.py)."""
        if says_ended(err.code.name, err.details):  # a restart would wait for them too
            restarts.declare_peers_ended()
        details = err.details + freed_slot(call.method, err.code, err.details, attempts)
        if attempts > 1:
            details += f" (after {attempts} attempts in {time.monotonic() - began:.1f} s)"
        if err.code == grpc.StatusCode.DEADLINE_EXCEEDED and call.method in WAITS_ON_PEERS:
            details = hang_report.complete(self, call.server, call.method, call.request, details)
        if details == err.details:
            return err
        return ShardClientError(err.server, err.address, err.method, err.code, details)

    def run(self, calls: Iterable[Call]) -> list[Any]:
        """Sends ``calls`` with at most ``max_in_flight`` outstanding, each server's in turn
        and a few at a time to a server of this host (client/call_order.py); returns replies
        in the order of ``calls``.

        A call failing with UNAVAILABLE is re-sent with jittered exponential backoff, up to
        ``retries`` times: every request is idempotent on the server, so this is always safe
        for its state (a read whose reply was lost may find its chunk freed: ``freed_slot``).
        A call a busy server refused (``is_busy``: RESOURCE_EXHAUSTED "retry later",
        docs/design.md §6.2), or its gRPC dropped unrun (more calls waited to be taken up than
        its ``--max-pending-calls``), is re-sent with backoff until it is admitted; other
        RESOURCE_EXHAUSTED errors (memory, sizes) are final. Every attempt of a call shares one
        deadline, ``timeout_s`` from its first attempt: retries never stretch a wait past it.
        """
        results: list[Any] = []
        queue = Batch(calls, self._room)  # each server's calls in turn (call_order.py)
        alone = queue.alone
        # (index, call, future, attempts after errors, busy refusals, first sent)
        in_flight: deque[tuple[int, Call, Any, int, int, float]] = deque()
        first_error: ShardClientError | None = None
        stale: set[int] = set()  # calls sent again after a server forgot their segment

        def submit() -> None:
            while queue and len(in_flight) < self.max_in_flight and first_error is None:
                if (taken := queue.take()) is None:
                    return  # its server's bound: after a call in flight ends
                i, call = taken
                began = time.monotonic()  # before: ``alone``, the call runs inside _send
                in_flight.append((i, call, self._send(call, alone), 0, 0, began))

        submit()
        while in_flight:
            i, call, fut, attempt, busy, began = in_flight.popleft()
            if call.method in WAITS_ON_PEERS:  # say who is missing while it waits
                say = partial(hang_report.still_waiting, self, call)
                slow_waits.wait(fut, began, began + self.timeout_s, self.wait_notice_s, say)
            try:
                reply = used_reply(fut, call.on_result)
            except grpc.FutureCancelledError:
                if first_error is None:  # not by another call's error: by a notice or close()
                    notice = self.run_state.current()
                    code = grpc.StatusCode.ABORTED if notice else grpc.StatusCode.CANCELLED
                    why = notice.ended_call(sent=True) if notice else "the client was closed"
                    first_error = self._error(call, LocalRpcError(code, why))
                continue  # cancelled after another call failed: that error is raised below
            except grpc.RpcError as exc:
                err = self._error(call, exc)
                deadline = began + self.timeout_s  # of every attempt of this call
                pause = busy_pause(busy, deadline) if is_busy(err) else None
                if attempt > 0 and call.retry_ok is not None and call.retry_ok(err):
                    reply = None  # the first attempt went through before the connection broke
                elif (
                    isinstance(fut, ShmFuture)
                    and is_stale(err.code, err.details)
                    and i not in stale
                    and deadline - time.monotonic() > MIN_ATTEMPT_S
                ):
                    # the server restarted (nothing was done): new segments, or in-band
                    self.shm.reset(self.spec.addresses[call.server])
                    stale.add(i)  # once per call: a second refusal is an error
                    fut = self._send(call, alone, timeout=deadline - time.monotonic())
                    in_flight.appendleft((i, call, fut, attempt, busy, began))
                    continue
                elif (
                    err.code in RETRYABLE
                    and attempt < self.retries
                    and (backoff := retry_pause(attempt, deadline))
                ):
                    time.sleep(backoff)
                    fut = self._send(call, alone, timeout=deadline - time.monotonic())
                    in_flight.appendleft((i, call, fut, attempt + 1, busy, began))
                    continue
                elif pause is not None:
                    time.sleep(pause)
                    fut = self._send(call, alone, timeout=deadline - time.monotonic())
                    in_flight.appendleft((i, call, fut, attempt, busy + 1, began))
                    continue
                else:
                    if first_error is None:
                        first_error = self._final(call, err, attempt + 1, began)
                    for _, _, other, *_ in in_flight:  # e.g. reads that would wait for ever
                        other.cancel()
                    continue
            if isinstance(fut, ShmFuture):  # the reply was read: the segment is free again
                reply = fut.settle(reply, consumed=call.on_result is not None)
            while len(results) <= i:
                results.append(None)
            results[i] = reply
            queue.done(call)
            submit()
        if first_error is not None:
            raise first_error
        return results

    def call(self, server: int, method: str, request: Any) -> Any:
        """One call, with the same retries as ``run``."""
        return self.run([Call(server, method, request)])[0]

    def close(self) -> None:
        """Releases the lease (the rank ends normally: nothing is aborted), cancels what is in
        flight, ends the sessions and lets the channels go (closed once no other client of the
        spec holds them: ``ClusterSpec.release``); idempotent."""
        closing.forget(self)
        leases.release(self)
        self.closed = True
        held, self._holds_spec = self._holds_spec, False
        with self._lock:
            pending = list(self._local_calls)
        for fut in pending:
            fut.cancel()
        self.sessions.close()
        self.shm.close()
        if held:
            self.spec.release()
