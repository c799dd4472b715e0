"""Standard gRPC services (health, reflection), Status contents, and the torch-free server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from paramshard.client import ClusterSpec, ParamInfo, ShardClient, StepArgs
from paramshard.protos.slicing import slice_bounds
from paramshard.server import ShardServer
from paramshard.server.runtime import backend

ROOT = Path(__file__).resolve().parent.parent
SHARD = "paramshard.v1.Shard"
METHODS = {
    "RegisterBuffer",
    "SetParams",
    "PushGrad",
    "PullParams",
    "GradNorm",
    "Step",
    "Contribute",
    "ReadSlot",
    "ContributeRead",
    "DropJob",
    "Status",
    "Lease",
    "HoldLease",
    "Join",
    "Snapshot",
    "CommitSnapshot",
    "Restore",
    "ListSnapshots",
    "DeleteSnapshot",
    "ConfigureReplication",
    "StoreReplica",
    "ListReplicas",
    "FetchReplica",
    "LoadReplica",
    "RollbackToReplica",
    "OfferSegment",
    "ConfirmSegment",
    "ReleaseSegments",
    "Session",
}


@pytest.fixture
def channel(servers) -> Iterator[grpc.Channel]:
    (s,) = servers(1)
    with grpc.insecure_channel(s.address) as chan:
        yield chan


def test_health_check_serving(channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", SHARD):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as info:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_reports_shutdown() -> None:
    s = ShardServer().start()
    with grpc.insecure_channel(s.address) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=SHARD), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        s.stop(grace=1.0)
        seen = []
        try:
            for reply in watch:
                seen.append(reply.status)
        except grpc.RpcError:
            pass  # the server went away after announcing it
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen


def test_reflection_lists_and_describes_the_services(channel: grpc.Channel) -> None:
    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    assert {SHARD, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    pool = descriptor_pool.DescriptorPool(db)
    shard = pool.FindServiceByName(SHARD)
    assert {m.name for m in shard.methods} == METHODS
    push = shard.FindMethodByName("PushGrad")
    assert push.input_type.full_name == "paramshard.v1.PushGradRequest"
    assert [f.number for f in push.input_type.fields] == [1, 15]


def status_rows(client: ShardClient) -> list[dict]:
    rows = client.status()
    assert all("error" not in r for r in rows), rows
    return rows


def test_status_reports_jobs_buffers_and_bytes(servers) -> None:
    addresses = [s.address for s in servers(2)]
    numel = 1001  # slices of 501 and 500
    c = ShardClient(ClusterSpec(addresses), timeout_s=10)
    try:
        began = time.time()
        c.register_buffer(
            "statjob",
            "w",
            numel,
            optimizer="adam",
            hyper={"lr": 0.01},
            params=[ParamInfo("lin.weight", (10, 100), 0), ParamInfo("lin.bias", (1,), 1000)],
        )
        c.register_buffer("statjob", "b", 3, optimizer="sgd", hyper={"lr": 0.1, "momentum": 0.9})
        c.set_params("statjob", "w", np.zeros(numel, np.float32))
        rows = status_rows(c)
        for i, row in enumerate(rows):
            assert row["device"] == backend.device  # cuda:N under PARAMSHARD_TEST_BACKEND
            assert row["uptime_seconds"] > 0
            assert int(row["server_index"]) == i and int(row["num_servers"]) == 2
            assert int(row["pid"]) == os.getpid()
            assert row["version"]
            assert int(row["device_memory_total"]) > int(row["device_memory_used"]) > 0
            (job,) = row["jobs"]
            assert job["job"] == "statjob"
            by_name = {b["buffer"]: b for b in job["buffers"]}
            assert set(by_name) == {"w", "b"}
            w = by_name["w"]
            lo, hi = slice_bounds(numel, 2, i)
            assert int(w["slice_start"]) == lo and int(w["slice_numel"]) == hi - lo
            assert int(w["numel"]) == numel and w["dtype"] == "float32"
            assert int(w["version"]) == 0 and w["initialized"] is True
            assert by_name["b"]["initialized"] is False
            assert w["optimizer"] == "adam" and by_name["b"]["optimizer"] == "sgd"
            assert w["hyper"]["lr"] == pytest.approx(0.01)
            assert by_name["b"]["hyper"]["momentum"] == pytest.approx(0.9)
            assert int(w["contributors"]) == 1
            assert [p["name"] for p in w["params"]] == ["lin.weight", "lin.bias"]
            assert int(w["param_bytes"]) == (hi - lo) * 4
            assert int(w["grad_bytes"]) == 0 and int(w["optimizer_bytes"]) == 0
            assert float(w["last_step_unix"]) == 0.0
            assert int(row["open_slots"]) == 0 and int(row["slot_bytes"]) == 0

        c.push_grads(
            "statjob", "w", np.ones(numel, np.float32), 0, step_args=StepArgs({"lr": 0.02})
        )
        c.pull_params("statjob", "w", numel, 1)
        for i, row in enumerate(status_rows(c)):
            w = next(b for b in row["jobs"][0]["buffers"] if b["buffer"] == "w")
            lo, hi = slice_bounds(numel, 2, i)
            assert int(w["version"]) == 1
            assert int(w["param_bytes"]) == (hi - lo) * 4
            assert int(w["grad_bytes"]) == (hi - lo) * 4
            assert int(w["optimizer_bytes"]) == 2 * (hi - lo) * 4  # exp_avg, exp_avg_sq
            assert w["hyper"]["lr"] == pytest.approx(0.02)  # the step's lr was applied
            assert float(w["last_step_seconds"]) >= 0.0
            assert began <= float(w["last_step_unix"]) <= time.time()
        c.drop_job("statjob")
        assert all(not row.get("jobs") for row in status_rows(c))
    finally:
        c.close()


def test_status_of_an_unreachable_server_is_an_error_row(servers) -> None:
    (s,) = servers(1)
    alive = s.address
    gone = ShardServer().start()
    dead = gone.address
    gone.stop(0)
    c = ShardClient(ClusterSpec([alive, dead]), timeout_s=2, retries=0)
    try:
        rows = c.status()
        assert "error" not in rows[0] and rows[0]["address"] == alive
        assert rows[1]["address"] == dead and "UNAVAILABLE" in rows[1]["error"]
    finally:
        c.close()


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_server_never_imports_torch() -> None:
    result = run_python(
        "import importlib, pkgutil, sys, paramshard.server as server\n"
        "for m in pkgutil.walk_packages(server.__path__, 'paramshard.server.'):\n"
        "    importlib.import_module(m.name)  # every module, the ones loaded on demand too\n"
        "assert 'torch' not in sys.modules, 'server imported torch'\n"
        "from paramshard.server import ShardServer\n"
        "s = ShardServer().start(); s.stop(0)\n"
        "assert 'torch' not in sys.modules, 'starting a server imported torch'\n"
    )
    assert result.returncode == 0, result.stderr


def test_client_and_protos_never_import_torch() -> None:
    result = run_python(
        "import sys, numpy as np, paramshard.client, paramshard.protos.codec\n"
        "import paramshard.protos.slicing\n"
        "from paramshard.server import ShardServer\n"
        "from paramshard.client import ClusterSpec, ShardClient\n"
        "s = ShardServer().start()\n"
        "c = ShardClient(ClusterSpec([s.address]))\n"
        "assert (c.all_reduce(np.ones(3, np.float32)) == 1).all()\n"
        "c.close(); s.stop(0)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.cupy
def test_cuda_server(servers) -> None:
    """The backend is chosen per process: switch back to NumPy for the other tests."""
    from paramshard.server.runtime import backend

    (s,) = servers(1, device="cuda:0")
    c = ShardClient(ClusterSpec([s.address]), timeout_s=10)
    try:
        (row,) = status_rows(c)
        assert row["device"] == "cuda:0"
        np.testing.assert_array_equal(
            c.all_reduce(np.arange(5, dtype=np.float32)), np.arange(5, dtype=np.float32)
        )
    finally:
        c.close()
        s.stop(0)
        backend.use_device("cpu")
