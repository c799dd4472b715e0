"""The device-to-device path: a server in the trainer's process, on the trainer's device.

A gradient push hands that server its piece as a DLPack tensor (``Outgoing.dlpack``) and a
pull gets its piece back as a device array (``Landing.put``): no pinned staging, no bytes
(strategies/device.py, protos/local_servers.py). On a GPU host that is a CuPy server on the
trainer's GPU; on this CPU host it is a NumPy (or strict) server and CPU tensors, so every line
but the CUDA copies runs here. The pieces for servers elsewhere cross the host as before.
Each strategy trained this way equals its run through gRPC; the CuPy-on-a-GPU run is marked
``gpu`` and ``cupy`` (skipped without them).
"""

from __future__ import annotations

import threading
from functools import partial

import numpy as np
import pytest
import torch
from numerics import assert_equivalent
from test_strategies import batches, initial_state, train_rank, train_sharded, train_single

from paramshard import LocalCluster
from paramshard.client import ClusterSpec, ShardClient, ShardClientError, StepArgs
from paramshard.server.runtime import backend
from paramshard.strategies.device import Landing, Outgoing

SHARDED = ["zero1", "zero2", "fsdp"]  # DDP's buckets go through the collectives, not pushes


def _address(values) -> int:
    """Where an imported array's memory starts (CuPy's device pointer; NumPy's, and the strict
    backend's, whose arrays hide their memory, through NumPy's own DLPack import)."""
    if type(values).__module__.startswith("cupy"):
        return int(values.data.ptr)
    host = values if isinstance(values, np.ndarray) else np.from_dlpack(values)
    return int(host.__array_interface__["data"][0])


@pytest.fixture
def handovers(monkeypatch):
    """Counts DLPack imports by the servers (and whether each shares the producer's memory)
    and device arrays handed to landings."""
    seen = {"imports": 0, "shared": 0, "landed": 0}
    lock = threading.Lock()  # the servers' handlers run in several threads
    real_import, real_put = backend.from_dlpack, Landing.put

    def counting_import(obj):
        values = real_import(obj)
        shared = isinstance(obj, torch.Tensor) and _address(values) == obj.data_ptr()
        with lock:
            seen["imports"] += 1
            seen["shared"] += shared
        return values

    def counting_put(self, start, values):
        with lock:
            seen["landed"] += 1
        return real_put(self, start, values)

    monkeypatch.setattr(backend, "from_dlpack", counting_import)
    monkeypatch.setattr(Landing, "put", counting_put)
    return seen


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ["ddp", *SHARDED])
def test_in_process_servers_equal_the_grpc_path(strategy, handovers):
    """Each strategy trained through gRPC (bytes only: no DLPack at all), then with the servers
    called in-process (ZeRO and FSDP: DLPack both ways), equal at 1e-9 in float64; both equal
    the single-process reference too."""
    init, data = initial_state(), batches()
    ref_losses, ref_state = train_single("adamw", init, data)
    grpc = train_sharded(strategy, "adamw", 2, 2, init, data, local_calls=False)
    assert handovers == {"imports": 0, "shared": 0, "landed": 0}, "gRPC servers saw DLPack"
    local = train_sharded(strategy, "adamw", 2, 2, init, data)
    for r, ((losses, state), (grpc_losses, grpc_state)) in enumerate(zip(local, grpc, strict=True)):
        assert_equivalent(losses, grpc_losses, f"{strategy} rank {r} losses, DLPack vs gRPC")
        assert_equivalent(state, grpc_state, f"{strategy} rank {r}, DLPack vs gRPC")
        assert_equivalent(state, ref_state, f"{strategy} rank {r} (DLPack) vs single process")
        assert_equivalent(losses, ref_losses, f"{strategy} rank {r} losses vs single process")
    if strategy == "ddp":  # buckets are all-reduced through the collectives, which cross the host
        assert handovers["imports"] == 0
        return
    assert handovers["imports"] > 0, "no gradient piece went to a server through DLPack"
    assert handovers["shared"] == handovers["imports"], "a DLPack import copied the tensor"
    assert handovers["landed"] > 0, "no pulled piece came back as a device array"


@pytest.mark.parametrize("local_calls", [True, False], ids=["in-process", "over-the-wire"])
def test_a_step_on_in_process_servers_makes_no_grpc_call(local_calls, monkeypatch):
    """A step's GradNorm and Step go to a server of the trainer's process directly, as its
    pushes and pulls do (``ShardServicer.LOCAL_METHODS``): they run on the in-process pool's
    threads, and on gRPC's only when the servers refuse in-process calls."""
    from paramshard.server.servicer import ShardServicer

    ran: list[tuple[str, str]] = []  # (handler, thread)
    for name in ("grad_norm", "step"):
        real = getattr(ShardServicer, name)

        def spy(self, req, context, _real=real, _name=name):
            ran.append((_name, threading.current_thread().name))
            return _real(self, req, context)

        monkeypatch.setattr(ShardServicer, name, spy)
    train_sharded("zero2", "adamw", 2, 2, initial_state(), batches(), local_calls=local_calls)
    assert {name for name, _ in ran} == {"grad_norm", "step"}, ran
    in_process = [thread.startswith("local-shard") for _, thread in ran]
    assert all(in_process) if local_calls else not any(in_process), ran


@pytest.mark.gpu
@pytest.mark.cupy
@pytest.mark.parametrize("strategy", SHARDED)
def test_cuda_trainers_and_cupy_servers_go_device_to_device(strategy, handovers):
    """A model on cuda:0 with its servers in the process on cuda:0 (CuPy): the slices move
    through DLPack on the GPU, and training equals the single-process CPU reference."""
    init, data = initial_state(), batches()
    ref_losses, ref_state = train_single("adamw", init, data)
    cluster = LocalCluster(
        2, 2, server_options={"device": "cuda:0"}, run_timeout_s=300, timeout_s=60.0
    )
    try:
        with cluster:
            fn = partial(train_rank, strategy, "adamw", init, data, device="cuda:0")
            results = cluster.run(fn)
    finally:
        backend.use_device("cpu")  # the array library is the process's: back for later tests
    for r, (losses, state) in enumerate(results):
        assert all(t.device.type == "cuda" for t in state.values()), f"rank {r} left the GPU"
        assert_equivalent(losses, ref_losses, f"{strategy} cuda rank {r} losses (DLPack)")
        on_cpu = {name: t.cpu() for name, t in state.items()}
        assert_equivalent(on_cpu, ref_state, f"{strategy} cuda rank {r} (DLPack)")
    assert handovers["imports"] > 0 and handovers["landed"] > 0, "the GPU slices took the host"
    assert handovers["shared"] == handovers["imports"], "a DLPack import copied the tensor"


def _client(servers, **kw) -> tuple[ShardClient, int]:
    (s,) = servers(1, **kw)
    c = ShardClient(ClusterSpec([s.address]), timeout_s=10)
    c.register_buffer("j", "b", 8, optimizer="sgd", hyper={"lr": 1.0})
    c.set_params("j", "b", np.zeros(8, np.float32))
    return c, s


def test_a_wrong_device_payload_is_refused_and_changes_nothing(servers):
    """A DLPack payload whose size or dtype disagrees with its header gets INVALID_ARGUMENT,
    like a wrong byte count does, and nothing is added."""
    c, _ = _client(servers)
    try:
        grads = Outgoing(torch.ones(8), torch.float32)
        short = Outgoing(torch.ones(8), torch.float32)
        short.dlpack = lambda start, n, wire: torch.ones(n - 1)
        wrong = Outgoing(torch.ones(8), torch.float32)
        wrong.dlpack = lambda start, n, wire: torch.ones(n, dtype=torch.float64)
        for bad, says in ((short, "7 float32"), (wrong, "float64")):
            with pytest.raises(ShardClientError, match="INVALID_ARGUMENT") as err:
                c.push_grads("j", "b", bad, step=0)
            assert "device payload" in str(err.value) and says in str(err.value)
        c.push_grads("j", "b", grads, step=0)
        c.step("j", 0, {"b": StepArgs({"lr": 1.0})})
        np.testing.assert_array_equal(c.pull_params("j", "b", 8, 1), -np.ones(8, np.float32))
    finally:
        c.close()


def test_bfloat16_pieces_travel_as_their_bits(servers, handovers):
    """A bfloat16 wire pushes and pulls through DLPack as int16/uint16 bits, rounded once."""
    c, _ = _client(servers)
    try:
        values = torch.tensor([1.0, 1 / 3, -2.5, 3e-3, 7.0, 0.0, -1e5, 2.0])
        c.push_grads("j", "b", Outgoing(values, torch.float32), step=0, dtype="bfloat16")
        c.step("j", 0, {"b": StepArgs({"lr": 1.0})})
        landing = Landing(8, "bfloat16", torch.device("cpu"))
        c.run(c.pull_calls("j", "b", landing, 1, dtype="bfloat16"))
        got = landing.result(torch.float32)
        want = -values.to(torch.bfloat16).to(torch.float32)
        assert torch.equal(got, want.to(torch.bfloat16).to(torch.float32))
        assert handovers["imports"] == 1 and handovers["landed"] == 1
    finally:
        c.close()


def test_a_piece_past_the_receive_limit_goes_through_grpc(servers, handovers):
    """A device piece larger than the server accepts is not handed over in-process: it goes
    as bytes through gRPC, which refuses it with its own message, as for any other caller."""
    (s,) = servers(1, max_receive_bytes=64 * 1024)
    c = ShardClient(ClusterSpec([s.address]), timeout_s=10)
    try:
        c.register_buffer("j", "b", 32 * 1024, optimizer="sgd", hyper={"lr": 1.0})
        grads = Outgoing(torch.ones(32 * 1024), torch.float32)  # 128 KiB in one chunk
        with pytest.raises(ShardClientError, match="RESOURCE_EXHAUSTED"):
            c.push_grads("j", "b", grads, step=0)
        assert handovers["imports"] == 0
    finally:
        c.close()
