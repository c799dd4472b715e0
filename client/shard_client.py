"""``ShardClient``: one per rank; collectives and flat buffers over all the shard servers."""

from __future__ import annotations

import os
from typing import Any

from google.protobuf.json_format import MessageToDict

from paramshard.client import leases
from paramshard.client.buffers import FlatBuffers
from paramshard.client.cluster import ClusterSpec
from paramshard.client.collectives import Collectives
from paramshard.client.lease_holds import LeaseConflict
from paramshard.client.rpc import DEFAULT_TIMEOUT_S, MAX_IN_FLIGHT, ShardClientError
from paramshard.client.run_id import UNNAMED, run_id_for, say_unnamed
from paramshard.protos import closing
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.run_ids import run_id_problem

__all__ = ["ShardClient"]


class ShardClient(Collectives, FlatBuffers):
    """Rank ``rank`` of ``world_size`` talking to the servers of ``spec``.

    ``run_id`` names this run's collective slots: all ranks of one run must agree on it, and two
    runs on the same servers must differ (default: ``PARAMSHARD_RUN``, which ``paramshard
    launch`` sets, else torchrun's ``TORCHELASTIC_RUN_ID``, else ``"run"``, which warns with
    peers: any other job without a run id shares it; client/run_id.py).
    ``chunk_bytes``: the most payload one message carries (default: ``default_chunk_bytes``
    of the servers on one host, 4 MiB for 4); every rank of a job must use the same.
    ``deterministic`` (default): sums and means of collectives are reduced in rank order,
    bitwise reproducible; False: in arrival order (strategies set it from their
    configuration's ``deterministic``).
    ``shared_memory``: payloads to servers on this host through shared segments (True), always
    in-band (False), or as ``PARAMSHARD_SHM`` says (None, the default: on unless it is 0);
    docs/transport.md.
    ``sessions``: data-plane calls travel in one persistent stream per server (True), each as
    its own call (False), or as ``PARAMSHARD_SESSIONS`` says (None: on unless it is 0).
    """

    def __init__(
        self,
        spec: ClusterSpec,
        rank: int = 0,
        world_size: int = 1,
        *,
        run_id: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = 5,
        max_in_flight: int = MAX_IN_FLIGHT,
        chunk_bytes: int | None = None,
        deterministic: bool = True,
        shared_memory: bool | None = None,
        sessions: bool | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of size {world_size}")
        run_id = run_id or run_id_for()
        problem = run_id_problem(run_id) if world_size > 1 else None  # see has_peers
        if problem is not None:  # the servers would refuse its leases
            raise ValueError(f"run id: {problem}")
        super().__init__(
            spec,
            timeout_s=timeout_s,
            retries=retries,
            max_in_flight=max_in_flight,
            chunk_bytes=chunk_bytes,
            shared_memory=shared_memory,
            sessions=sessions,
        )
        self.rank = rank
        self.world_size = world_size
        self.has_peers = world_size > 1
        """Whether this rank's job has other ranks: only then it holds leases (they tell the
        others when it dies), so only then its run id is checked and named to servers. Views
        and groups keep their client's (a group of one in a larger job still has peers)."""
        self.cluster_size = len(spec)
        """How many servers the cluster this client was made for has."""
        self.servers = list(range(len(spec)))
        """The global index (in the cluster this client was made for) of each of its servers;
        a group's client has its members' servers only."""
        self.rank_servers: list[int] | None = None
        """Group rank -> index of that member's own server here (None: rank r's is r mod N)."""
        self.run_id = run_id
        if self.run_id == UNNAMED and self.has_peers:
            say_unnamed()
        self.deterministic = deterministic
        closing.close_at_exit(self, ShardClient.close)  # if the program forgets (or raises)
        if self.has_peers:
            try:
                leases.hold(self)  # the other ranks learn within seconds if this one dies
            except LeaseConflict:
                self.close()
                raise

    @classmethod
    def from_env(cls, **kw: Any) -> ShardClient:
        """Reads PARAMSHARD_SERVERS, RANK and WORLD_SIZE like torchrun's env:// init."""
        return cls(
            ClusterSpec.from_env(),
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            **kw,
        )

    def subgroup(self, ranks: list[int], name: str) -> ShardClient:
        """A client for collectives among ``ranks`` only (a tensor-, pipeline- or data-parallel
        group): this rank's index in the group is its rank, the group's size its world size,
        and its slot keys live under ``<run_id>/<name>`` so groups never collide.

        The group works on its members' own servers (rank r's is server ``r mod N``), in
        member order without repeats: a mailbox for a member is on that member's server, and a
        flat buffer registered through the group is sharded over the group's servers only (a
        3D job's data-parallel replicas shard their part over their own servers, as ZeRO
        shards within its data-parallel group). Shares this client's channels; makes no RPC.
        Every member calls it with the same ranks and name.

        The same ranks and name give the same group while the run id stands (a second model of
        the script's, an evaluation model beside the trained one): its collectives go on
        numbering where the first model's left off, on every member alike, as torch's process
        groups are shared by the models built on them. A fresh group counting from 1 again
        would meet the first's freed slots ("behind the other ranks' collectives")."""
        known = self.__dict__.setdefault("_subgroups", {})
        cached = known.get((self.run_id, name, tuple(ranks)))
        if cached is not None:
            return cached
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not in group {name!r} {list(ranks)}")
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(
                f"group {name!r}: ranks {list(ranks)} must be distinct and inside"
                f" 0..{self.world_size - 1}"
            )
        own = [self.server_of(r) for r in ranks]  # each member's server, in this client's spec
        servers = list(dict.fromkeys(own))
        group = self.on_servers(servers)
        group.rank_servers = [servers.index(s) for s in own]
        group.rank = list(ranks).index(self.rank)
        group.world_size = len(ranks)
        group.run_id = f"{self.run_id}/{name}"
        parent = getattr(self, "global_ranks", None)
        group.global_ranks = [parent[r] for r in ranks] if parent else list(ranks)
        known[(self.run_id, name, tuple(ranks))] = group
        return group

    def on_servers(self, servers: list[int]) -> ShardClient:
        """This client (same rank, world and run) on the servers ``servers`` only, in that
        order: server i of the result is server ``servers[i]`` here. A job held by some
        servers only is driven through such a view (``client.jobs``); channels and stubs are
        shared, and collective numbering starts afresh."""
        view = ShardClient.__new__(ShardClient)
        view.__dict__.update(
            {
                k: v
                for k, v in self.__dict__.items()
                if k not in ("_seq", "_p2p_seq", "_base_run_id", "_subgroups")
            }
        )
        view.spec = self.spec.subset(servers)
        view._holds_spec = False  # the channels are this client's: its close() releases them
        view.servers = [self.servers[s] for s in servers]
        view.rank_servers = None
        return view

    def status(self, pending: bool = False, max_pending: int = 0) -> list[dict[str, Any]]:
        """One dict per server: its Status reply, or ``{"error": ...}`` when it is unreachable.
        ``pending``: with what waits on each server (``pending``, at most ``max_pending``
        rows, 0: the server's default of 100; ``pending_left_out`` more were not listed)."""
        request = pb.StatusRequest(pending=pending, max_pending=max_pending)
        out = []
        for i, address in enumerate(self.spec.addresses):
            try:
                reply = self.call(i, "Status", request)
                row = MessageToDict(
                    reply,
                    preserving_proto_field_name=True,
                    always_print_fields_with_no_presence=True,
                )
            except ShardClientError as exc:
                row = {"error": f"{exc.code.name}: {exc.details}"}
            out.append({"address": address, "index": i, **row})
        return out

    def __repr__(self) -> str:
        return (
            f"ShardClient(rank={self.rank}, world_size={self.world_size}, "
            f"servers={list(self.spec.addresses)})"
        )
