"""Hostile replicas' helpers (tests/test_hostile_replicas.py, tests/test_hostile_replica_inputs.py):
raw calls by name that never accept INTERNAL or UNKNOWN, replicas crafted by hand, and what a
hostile call must leave as it was."""

from __future__ import annotations

import base64
import json
from typing import Any

import grpc
import numpy as np
from test_hardening_replication import TOKENS, client_for

from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.servicer import SERVICE_NAME
from paramshard.server.snapshots.shards import Captured, encode_shard

Code = grpc.StatusCode
HOSTILE_TOKENS = {**TOKENS, "a-admin": "admin jobs=team-a-*"}
NUMEL = 4
PARAMS = np.arange(NUMEL, dtype=np.float32)
METHODS = pb.DESCRIPTOR.services_by_name["Shard"].methods_by_name


def call(address: str, method: str, req: Any, token: str | None = "admin-secret") -> Any:
    """One raw call: its reply, or the grpc.RpcError it ended with (never INTERNAL/UNKNOWN)."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    reply = getattr(pb, METHODS[method].output_type.name)
    with grpc.insecure_channel(address) as chan:
        stub = chan.unary_unary(
            f"/{SERVICE_NAME}/{method}",
            request_serializer=type(req).SerializeToString,
            response_deserializer=reply.FromString,
        )
        try:
            return stub(req, timeout=30, metadata=metadata)
        except grpc.RpcError as exc:
            assert exc.code() not in (Code.INTERNAL, Code.UNKNOWN), f"{method}: {exc.details()}"
            return exc


def refused(address: str, method: str, req: Any, code: Code, token: str = "admin-secret") -> str:
    out = call(address, method, req, token)
    assert isinstance(out, grpc.RpcError), f"{method} accepted: {out}"
    assert out.code() == code, out.details()
    return out.details()


def code_of(out: Any) -> Any:
    return out.code() if isinstance(out, grpc.RpcError) else "OK"


def spec(job: str, buffer: str = "w", numel: int = NUMEL, index: int = 0, num: int = 1) -> bytes:
    return pb.RegisterBufferRequest(
        ref=pb.BufferRef(job=job, buffer=buffer),
        numel=numel,
        server_index=index,
        num_servers=num,
        contributors=1,
        optimizer=pb.OptimizerSpec(name="sgd", hyper={"lr": 0.1}),
    ).SerializeToString()


def crafted(job: str, version: Any, buffers: dict[str, Any], tensors: dict[str, Any]) -> bytes:
    """Safetensors bytes by hand, as server 0 of 1: any metadata; tensors name -> (dtype,
    shape, bytes, data_offsets or None)."""
    meta = {"job": job, "tag": "replica", "version": version, "server_index": 0}
    meta.update(num_servers=1, buffers=buffers)
    header: dict[str, Any] = {"__metadata__": {"paramshard": json.dumps(meta)}}
    body = b""
    for name, (dtype, shape, data, lie) in tensors.items():
        offsets = lie or [len(body), len(body) + len(data)]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        body += data
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + body


def layout(job: str, buffer: str = "w", step_count: Any = 0, **kw: Any) -> dict[str, Any]:
    """One buffer's entry in a crafted replica's metadata (``kw``: its spec's)."""
    spec_b64 = base64.b64encode(spec(job, buffer, **kw)).decode()
    return {"slice_start": 0, "step_count": step_count, "state": [], "spec": spec_b64}


def params(name: str = "w") -> dict[str, Any]:
    return {f"{name}::params": ("F32", [NUMEL], PARAMS.tobytes(), None)}


def chunk(job: str, blob: bytes, version: int = 1, **kw: Any) -> pb.ReplicaChunk:
    return pb.ReplicaChunk(job=job, version=version, total=len(blob), data=blob, **kw)


def own_replica(version: int = 1, job: str = "j", n: int = NUMEL) -> bytes:
    """A well-formed replica of ``job`` (slice 0 of 1, ``n`` elements) at ``version``."""
    captured = [Captured("w", 0, np.full(n, version, np.float32), {}, 0)]
    return encode_shard(job, "replica", 0, 1, version, captured, {"w": spec(job, numel=n)})


def state(server: ShardServer) -> tuple[Any, ...]:
    """What a hostile call must leave as it was: the jobs' buffers and placements, job 'j''s
    params (a trainer's pull over gRPC), its replicas listed, and the memory account."""
    jobs = {
        job: sorted(
            (b.name, b.version, b.numel, b.spec.server_index, b.spec.num_servers) for b in s
        )
        for job, s in server.servicer.buffers.jobs().items()
    }
    trainer = client_for([server.address], token="trainer-secret")
    try:
        pulled = trainer.pull_params("j", "w", NUMEL).tolist()
    finally:
        trainer.close()
    assert isinstance(call(server.address, "Status", pb.StatusRequest()), pb.StatusReply)
    listed = call(server.address, "ListReplicas", pb.ListReplicasRequest(job="j"), "reader-secret")
    return jobs, pulled, list(listed.replicas), server.servicer.budget.usage()


def hold_job(address: str) -> None:
    """Job 'j' on the server at ``address``: one buffer 'w' of 4 elements, slice 0 of 1."""
    c = client_for([address])
    try:
        c.register_buffer("j", "w", NUMEL, optimizer="sgd", hyper={"lr": 0.1})
        c.set_params("j", "w", PARAMS)
    finally:
        c.close()


def hostile_server(servers: Any) -> ShardServer:
    """A server with tokens holding job 'j' (``hold_job``)."""
    (node,) = servers(1, tokens=HOSTILE_TOKENS, local_calls=False)
    hold_job(node.address)
    return node
