"""The gRPC face of the store: decode, check, call the store, encode; never crash on a request.

Handlers are registered as generic handlers with our own (de)serialisers so tensor payloads take
the hand-encoded fast path of protos/codec.py; with ``fast_codec=False`` the same methods go
through the protobuf runtime instead (the benchmark compares the two). A deserialiser never
raises: a malformed request becomes INVALID_ARGUMENT with the parser's complaint, not grpcio's
generic INTERNAL "Exception deserializing request!".
"""

from __future__ import annotations

import functools
import re
import secrets
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import grpc

from paramshard.protos import batches, codec
from paramshard.protos import shard_pb2 as pb
from paramshard.server import call_peeks
from paramshard.server.buffers.step_replies import grad_norm_reply, step_reply
from paramshard.server.buffers.store import BufferStore
from paramshard.server.collectives.contribute_read import contribute_read
from paramshard.server.collectives.lease_holds import hold_lease
from paramshard.server.collectives.leases import LeaseTable
from paramshard.server.collectives.membership import MembershipTable
from paramshard.server.collectives.slots import SlotStore
from paramshard.server.replication.replicator import Replicator
from paramshard.server.rpc.auth import SERVICE_NAME, caller_of  # SERVICE_NAME: the proto's
from paramshard.server.rpc.guard import guard
from paramshard.server.rpc.parsers import MODEL_BYTES, plain, tensor, tensor_reply
from paramshard.server.rpc.scopes import Scope
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.limits import MemoryBudget
from paramshard.server.snapshot_calls import SnapshotCalls
from paramshard.server.snapshots.files import SnapshotDir
from paramshard.server.status import status_reply
from paramshard.server.transport.shm import SegmentRegistry

__all__ = ["SERVICE_NAME", "ShardServicer", "VERSION"]

VERSION = version("paramshard")
"""The installed distribution's version (pyproject.toml holds the one there is)."""


def handler_name(method: str) -> str:
    """The servicer's handler of an RPC: ``ReadSlot`` -> ``read_slot``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", method).lower()


class ShardServicer:
    """Implements the Shard service over a BufferStore and a SlotStore."""

    def __init__(
        self,
        *,
        max_wait_s: float = 120.0,
        max_job_bytes: int = 0,
        max_slot_bytes: int = 0,
        snapshot_dir: str | None = None,
        max_memory: int = 0,
        pending_ttl_s: float = 600.0,
    ) -> None:
        """``max_memory``: bytes this server may hold for its callers (0: no limit, see
        server/runtime/limits.py); ``pending_ttl_s``: slots and mailboxes untouched that long expire
        (``SlotStore.expire``, run by the server's sweeper)."""
        self.budget = MemoryBudget(max_memory)
        self.buffers = BufferStore(max_job_bytes=max_job_bytes, budget=self.budget)
        self.snapshot_calls = SnapshotCalls(self.buffers, SnapshotDir(snapshot_dir))
        self.replicator = Replicator(self.buffers)
        self.buffers.added = self.replicator.adopt  # restored or late slices replicate too
        self.slots = SlotStore(
            max_bytes=max_slot_bytes, budget=self.budget, ttl_s=pending_ttl_s,
            turns=self.buffers.turns,  # one bound on waits for a turn, server wide
        )  # fmt: skip
        self.leases = LeaseTable(self.slots, forget_s=pending_ttl_s)
        self.slots.news = self.buffers.news = self.leases
        self.snapshot_calls.live_ranks = self.leases.live_ranks
        self.membership = MembershipTable(self.leases, self._job_version, forget_s=pending_ttl_s)
        self.segments = SegmentRegistry(self.budget, idle_s=pending_ttl_s)
        # the admission gate's ``wait_in``, for a ContributeRead that waits (server/app.py)
        self.wait_in: Callable[[Any], tuple[str | None, Callable[[], None]]] | None = None
        self.max_wait_s = max_wait_s
        self.started = time.time()
        self.incarnation = secrets.randbits(64) or 1  # this process (LeaseReply.incarnation)
        self.server_index = 0
        self.num_servers = 0
        self.scope_of: Callable[[Any], Scope | None] = lambda context: None
        """The scope of a call's token (server/rpc/scopes.py; None: every job), for the calls
        that name no job and show only what is in scope (Status, ListSnapshots); the server
        sets it when it has tokens. Calls that name a job were checked before they came."""

    # -- plumbing ------------------------------------------------------------------------
    def _timeout(self, context: grpc.ServicerContext) -> float:
        """How long a call may wait: the caller's deadline less a margin (5%, at most 1 s),
        so the server's DEADLINE_EXCEEDED, which names what it waited for, reaches the caller
        before its own deadline's bare one, on a loaded machine too (0.2 s was not enough
        there: issue 26); at most ``max_wait_s``."""
        remaining = context.time_remaining()
        if remaining is None:
            return self.max_wait_s
        return max(0.0, min(remaining - min(1.0, 0.05 * remaining), self.max_wait_s))

    def generic_handler(self, fast_codec: bool = True) -> grpc.GenericRpcHandler:
        fast = fast_codec
        self._encode_pull = codec.encode if fast else None
        unary = grpc.unary_unary_rpc_method_handler
        plain_reply = codec.serialize
        table = {
            "RegisterBuffer": (
                self.register_buffer,
                plain(pb.RegisterBufferRequest, MODEL_BYTES),
                plain_reply,
            ),
            "SetParams": (
                self.set_params,
                tensor(pb.SetParamsHeader, pb.SetParamsRequest, fast),
                plain_reply,
            ),
            "PushGrad": (
                self.push_grad,
                tensor(pb.PushGradHeader, pb.PushGradRequest, fast),
                plain_reply,
            ),
            "PullParams": (
                self.pull_params,
                plain(pb.PullParamsRequest),
                tensor_reply(pb.PullParamsReply, fast),
            ),
            "GradNorm": (self.grad_norm, plain(pb.GradNormRequest), plain_reply),
            "Step": (self.step, plain(pb.StepRequest), plain_reply),
            "Contribute": (
                self.contribute,
                tensor(pb.SlotHeader, pb.ContributeRequest, fast),
                plain_reply,
            ),
            "ReadSlot": (
                self.read_slot,
                plain(pb.ReadSlotRequest),
                tensor_reply(pb.ReadSlotReply, fast),
            ),
            "ContributeRead": (
                self.contribute_read,
                tensor(pb.SlotHeader, pb.ContributeRequest, fast),
                tensor_reply(pb.ReadSlotReply, fast),
            ),
            "DropJob": (self.drop_job, plain(pb.DropJobRequest), plain_reply),
            "Status": (self.status, plain(pb.StatusRequest), plain_reply),
            "Lease": (self.lease, plain(pb.LeaseRequest), plain_reply),
            "Join": (self.join, plain(pb.JoinRequest), plain_reply),
            "Snapshot": (self.snapshot, plain(pb.SnapshotRequest), plain_reply),
            "CommitSnapshot": (
                self.commit_snapshot,
                plain(pb.CommitSnapshotRequest, MODEL_BYTES),
                plain_reply,
            ),
            "Restore": (self.restore, plain(pb.RestoreRequest), plain_reply),
            "ListSnapshots": (
                self.list_snapshots,
                plain(pb.ListSnapshotsRequest),
                plain_reply,
            ),
            "DeleteSnapshot": (
                self.delete_snapshot,
                plain(pb.DeleteSnapshotRequest),
                plain_reply,
            ),
            "ConfigureReplication": (
                self.configure_replication,
                plain(pb.ReplicationConfig),
                plain_reply,
            ),
            "StoreReplica": (self.store_replica, plain(pb.ReplicaChunk, None), plain_reply),
            "ListReplicas": (self.list_replicas, plain(pb.ListReplicasRequest), plain_reply),
            "FetchReplica": (self.fetch_replica, plain(pb.FetchReplicaRequest), plain_reply),
            "LoadReplica": (self.load_replica, plain(pb.ReplicaChunk, None), plain_reply),
            "RollbackToReplica": (self.rollback, plain(pb.RollbackRequest), plain_reply),
            **self.segments.handlers(),
        }
        guarded = {name: (guard(name, fn), de, ser) for name, (fn, de, ser) in table.items()}
        self.session_handlers = {name: guarded[name] for name in self.SESSION_METHODS}
        handlers = {
            name: unary(fn, request_deserializer=de, response_serializer=ser)
            for name, (fn, de, ser) in guarded.items()
        }
        handlers["HoldLease"] = grpc.unary_stream_rpc_method_handler(
            guard("HoldLease", self.hold_lease),  # a bad request fails before it streams
            request_deserializer=plain(pb.LeaseRequest),
            response_serializer=plain_reply,
        )
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    def close(self, why: str) -> None:
        """The server stops: every call still waiting ends with ``why`` (slot reads, pulls
        and steps waiting for a version, lease streams), so every handler thread returns."""
        self.leases.close()
        self.slots.interrupt(why)
        self.buffers.interrupt(why)

    SESSION_METHODS = {m: handler_name(m) for m in batches.SESSION_METHODS}
    """The data-plane methods sessions carry (``session_handlers``,
    server/transport/sessions.py), each with its handler's name here."""
    LOCAL_METHODS = {**SESSION_METHODS, **{m: handler_name(m) for m in ("GradNorm", "Step")}}
    """What a client in this process may run directly (``call_local``): the data plane and a
    step's two calls, so a step on a rank's own server makes no gRPC call
    (docs/benchmarks.md, "In-process steps")."""

    def call_local(
        self, method: str, request: Any, context: Any, device_reply: bool = False
    ) -> Any:
        """Runs data-plane ``method`` for a client of this process (protos/local_servers.py)
        as its gRPC handler would, errors included. A tensor payload may be a DLPack-capable
        array on this server's device; with ``device_reply`` a PullParams reply is
        (header, device array): the values move device to device, never through the host."""
        fn = getattr(self, self.LOCAL_METHODS[method])
        if device_reply and method == "PullParams":
            fn = self._pull_on_device
        if method == "ContributeRead":  # the payload is the caller's own array: copied
            fn = functools.partial(self.contribute_read, local=True)
        return guard(method, fn)(request, context)

    def _pull_on_device(self, req: pb.PullParamsRequest, context: Any) -> Any:
        b = self.buffers.get(req.ref.job, req.ref.buffer)
        return b.pull(req, self._timeout(context), on_device=True)

    def may_wait(self, method: str, request: Any) -> bool:
        """For the admission gate: server/call_peeks.py."""
        return call_peeks.may_wait(self.buffers, method, request)

    def reply_bytes(self, method: str, request: Any) -> int:
        """For sessions: server/call_peeks.py."""
        return call_peeks.reply_bytes(self.slots, method, request)

    # -- buffers ---------------------------------------------------------------------------
    def register_buffer(self, req: pb.RegisterBufferRequest, context: Any) -> Any:
        b = self.buffers.register(req)
        self.server_index, self.num_servers = req.server_index, req.num_servers
        with b.cond:
            return pb.RegisterBufferReply(
                slice_start=b.start,
                slice_numel=b.slice_numel,
                version=b.version,
                initialized=b.initialized,
            )

    def set_params(self, msg: tuple[pb.SetParamsHeader, memoryview], context: Any) -> Any:
        header, data = self.segments.payload(msg, context)
        b = self.buffers.get(header.ref.job, header.ref.buffer)
        return pb.SetParamsReply(initialized=b.set_params(header, data))

    def push_grad(self, msg: tuple[pb.PushGradHeader, memoryview], context: Any) -> Any:
        header, data = self.segments.payload(msg, context)
        b = self.buffers.get(header.ref.job, header.ref.buffer)
        return b.push_grad(header, data, self._timeout(context))

    def pull_params(self, req: pb.PullParamsRequest, context: Any) -> Any:
        b = self.buffers.get(req.ref.job, req.ref.buffer)
        encode = self.segments.reply_encoder(req, context, getattr(self, "_encode_pull", None))
        return b.pull(req, self._timeout(context), encode)

    def grad_norm(self, req: pb.GradNormRequest, context: Any) -> Any:
        slices = [self.buffers.get(req.job, name) for name in req.buffers]
        return grad_norm_reply(slices, req, self._timeout(context))

    def step(self, req: pb.StepRequest, context: Any) -> Any:
        slices = [(self.buffers.get(req.job, s.buffer), s.args) for s in req.buffers]
        return step_reply(slices, req, self._timeout(context))  # server/buffers/nonfinite.py

    # -- slots ---------------------------------------------------------------------------
    def contribute(self, msg: tuple[pb.SlotHeader, memoryview], context: Any) -> Any:
        header, data = self.segments.payload(msg, context)
        duplicate = self.slots.contribute(header, data, self._timeout(context))
        return pb.ContributeReply(duplicate=duplicate)

    def read_slot(self, req: pb.ReadSlotRequest, context: Any) -> Any:
        view = self.segments.reply_view(req, context)  # refused before the read frees anything
        return self.segments.reply(req, view, *self.slots.read(req, self._timeout(context)))

    def contribute_read(
        self, msg: tuple[pb.SlotHeader, memoryview], context: Any, local: bool = False
    ) -> Any:
        """``local``: a call of this process, which passes no gate and whose payload is the
        caller's own array (server/collectives/contribute_read.py)."""
        header, data = self.segments.payload(msg, context)
        view = self.segments.reply_view(header, context)  # refused before anything changes
        gated = not local and self.wait_in is not None
        wait_in = functools.partial(self._wait_in, context) if gated else None
        timeout = self._timeout(context)
        got = contribute_read(self.slots, header, data, timeout, not local, wait_in)
        return self.segments.reply(header, view, *got)

    def _wait_in(self, context: Any) -> Callable[[], None]:
        refusal, leave = self.wait_in(context.invocation_metadata())
        if refusal is not None:
            raise ShardError.exhausted(f"its contribution is in; its wait: {refusal}")
        return leave

    # -- administration ------------------------------------------------------------------
    def drop_job(self, req: pb.DropJobRequest, context: Any) -> Any:
        """Drops job ``req.job`` (its buffers and their pending contributions, its replicas)
        and the slots and mailboxes of the run of that name: slot keys carry the run, not the
        job. NOT_FOUND when there is neither."""
        if not req.job:
            raise ShardError.invalid("DropJob needs a job (or run) name")
        runs = self.slots.drop_run(req.job) + self.leases.drop(req.job)
        runs += self.membership.drop(req.job)
        try:
            dropped, missing = self.buffers.drop(req.job), None
        except ShardError as exc:
            dropped, missing = 0, exc
        # its replicas, its neighbour's channel: also what a call racing an earlier DropJob
        # may have left of a job no longer here
        replicas = self.replicator.drop(req.job)
        if missing is not None and not runs and not replicas:
            raise missing
        return pb.DropJobReply(buffers=dropped)

    def status(self, req: pb.StatusRequest, context: Any) -> Any:
        return status_reply(self, req, VERSION, self.scope_of(context))

    def lease(self, req: pb.LeaseRequest, context: Any) -> Any:
        reply = self.leases.renew(req, caller_of(context))
        reply.incarnation = self.incarnation
        return reply

    def hold_lease(self, req: pb.LeaseRequest, context: Any) -> Any:
        return hold_lease(self.leases, req, context, caller_of(context))

    def join(self, req: pb.JoinRequest, context: Any) -> Any:
        return self.membership.join(req, self._timeout(context), caller_of(context))

    def _job_version(self, job: str) -> int | None:
        """This server's version of ``job`` (its slices' lowest), None when it holds none."""
        slices = self.buffers.jobs().get(job)
        return min(b.version for b in slices) if slices else None

    @property
    def snapshots(self) -> SnapshotDir:
        """This server's snapshot folder (the snapshot calls' one: set it there, or here)."""
        return self.snapshot_calls.snapshots

    @snapshots.setter
    def snapshots(self, folder: SnapshotDir) -> None:
        self.snapshot_calls.snapshots = folder

    # -- snapshots (server/snapshot_calls.py) ---------------------------------------------
    def snapshot(self, req: pb.SnapshotRequest, context: Any) -> Any:
        return self.snapshot_calls.snapshot(req, self._timeout(context))

    def commit_snapshot(self, req: pb.CommitSnapshotRequest, context: Any) -> Any:
        return self.snapshot_calls.commit(req)

    def restore(self, req: pb.RestoreRequest, context: Any) -> Any:
        reply = self.snapshot_calls.restore(req)
        if not req.check_only and not req.into:  # a job read out beside the others: no placement
            self.server_index, self.num_servers = req.server_index, req.num_servers
        return reply

    def list_snapshots(self, req: pb.ListSnapshotsRequest, context: Any) -> Any:
        return self.snapshot_calls.list(req, self.scope_of(context))

    def delete_snapshot(self, req: pb.DeleteSnapshotRequest, context: Any) -> Any:
        return self.snapshot_calls.delete(req)

    # -- neighbour replication ---------------------------------------------------------------
    def configure_replication(self, req: pb.ReplicationConfig, context: Any) -> Any:
        self.replicator.configure(req)
        return pb.ReplicationConfigReply()

    def store_replica(self, req: pb.ReplicaChunk, context: Any) -> Any:
        data = self.segments.chunk_bytes(req, context)
        return pb.ReplicaAck(complete=self.replicator.store_chunk(req, data))

    def list_replicas(self, req: pb.ListReplicasRequest, context: Any) -> Any:
        cfg = self.replicator.configs.get(req.job)
        return pb.ListReplicasReply(
            server_index=cfg.server_index if cfg else 0,
            replicas=self.replicator.list(req.job),
            failure=self.replicator.failures.get(req.job, ""),
        )

    def fetch_replica(self, req: pb.FetchReplicaRequest, context: Any) -> Any:
        return self.replicator.fetch(req)

    def load_replica(self, req: pb.ReplicaChunk, context: Any) -> Any:
        data = self.segments.chunk_bytes(req, context)
        return pb.ReplicaAck(complete=self.replicator.load_chunk(req, data))

    def rollback(self, req: pb.RollbackRequest, context: Any) -> Any:
        version = self.replicator.rollback(req.job, req.version)
        return pb.RestoreReply(tag="replica", version=version)
