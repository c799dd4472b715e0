"""The tiny-GPT training job that the snapshot, export and job-tool tests share: servers with a
snapshot folder, seeded weights and batches, a job trained by W ranks (threads) with FSDP or
ZeRO-1, pulls of its state, and the single-process float64 reference it must equal.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from conftest import run_ranks
from numerics import assert_equivalent

from paramshard.client import ClusterSpec, ShardClient, ShardClientError, tools
from paramshard.models.gpt import GPT, Block, GPTConfig, lm_loss
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.strategies import (
    DATA_PARALLEL,
    ShardingConfiguration,
)

CFG = GPTConfig.tiny(vocab_size=50, n_embd=32, n_head=2, bias=False)
STEPS, SNAP_AT, BATCH, T, WORLD = 6, 3, 4, 8, 2
STRATEGIES = {k: DATA_PARALLEL[k] for k in ("fsdp", "zero1")}


def snapshot_servers(servers: Any, n: int, root: Path | str | None) -> list[ShardServer]:
    """``n`` started servers whose snapshot directory is ``root`` (None: no directory)."""
    if root is None:
        return servers(n)
    return servers(n, snapshot_dir=str(root))


def initial_weights(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    torch.manual_seed(11)
    return {k: v.to(dtype).clone() for k, v in GPT(CFG).state_dict().items()}


def new_gpt(init: dict[str, torch.Tensor]) -> GPT:
    """A GPT in the dtype of ``init``, loaded with it."""
    net = GPT(CFG).to(next(iter(init.values())).dtype)
    net.load_state_dict(init)
    return net


def batches(steps: int = STEPS) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, CFG.vocab_size, (steps, BATCH, T + 1), generator=g)


def new_job(prefix: str = "snap") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wrap(strategy: str, client: ShardClient, job: str, init: dict) -> tuple[Any, Any]:
    model_cls, opt_cls = STRATEGIES[strategy]
    config = ShardingConfiguration(client, job=job)
    net = new_gpt(init)
    model = model_cls(net, config, wrap=(Block,)) if strategy == "fsdp" else model_cls(net, config)
    opt = opt_cls(torch.optim.AdamW(net.param_groups(0.1), lr=1e-2), config)
    return model, opt


def train_steps(model: Any, opt: Any, rank: int, world: int, data: torch.Tensor, steps) -> None:
    per = BATCH // world
    for s in steps:
        part = data[s, rank * per : (rank + 1) * per]
        loss = lm_loss(model(part[:, :-1]), part[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()


def one_rank(addresses: list[str], steps: int) -> tuple[str, ShardClient, Any, Any, torch.Tensor]:
    """A new ZeRO-1 job on ``addresses`` trained ``steps`` steps by one rank: (job, its
    client, model, optimizer, batches), to go on training it."""
    job = new_job()
    trainer = ShardClient(ClusterSpec(addresses), timeout_s=20.0)
    model, opt = wrap("zero1", trainer, job, initial_weights())
    data = batches()
    train_steps(model, opt, 0, 1, data, range(steps))
    return job, trainer, model, opt, data


def client_for(addresses: list[str]) -> ShardClient:
    return ShardClient(ClusterSpec(list(addresses)), timeout_s=20.0, retries=1)


def pull_all(addresses: list[str], job: str) -> dict[str, np.ndarray]:
    c = client_for(addresses)
    try:
        return {r.name: tools.get_param(c, job, r.name) for r in tools.job_params(c, job)}
    finally:
        c.close()


def versions_of(addresses: list[str], job: str) -> set[int]:
    c = client_for(addresses)
    try:
        return {
            b.version
            for i in range(c.num_servers)
            for j in c.call(i, "Status", pb.StatusRequest()).jobs
            if j.job == job
            for b in j.buffers
        }
    finally:
        c.close()


def assert_same(state: dict, ref: dict, what: str = "restored") -> None:
    assert state.keys() == ref.keys()
    assert_equivalent(state, ref, what)


def train_job(
    servers: Any, n: int, root: Path | None, strategy: str = "fsdp", snap: str | None = "k"
) -> tuple[list[str], str, dict, int]:
    """W=2 ranks train STEPS steps on ``n`` servers; rank 0 snapshots tag ``snap`` after
    SNAP_AT steps while rank 1 goes on training. Returns (addresses, job, final state, the
    snapshot's version)."""
    init, data = initial_weights(), batches()
    job = new_job()
    addresses = [s.address for s in snapshot_servers(servers, n, root)]

    def rank(client: ShardClient) -> tuple[dict, int]:
        model, opt = wrap(strategy, client, job, init)
        train_steps(model, opt, client.rank, WORLD, data, range(SNAP_AT))
        version = -1
        if snap and client.rank == 0:  # rank 1 does not wait: it is already in step SNAP_AT
            version = tools.snapshot(client, job, snap)["version"]
        train_steps(model, opt, client.rank, WORLD, data, range(SNAP_AT, STEPS))
        return model.state_dict(), version

    (state, version), _ = run_ranks(rank, WORLD, addresses)
    return addresses, job, state, version


def continue_job(addresses: list[str], job: str, strategy: str, start: int) -> dict:
    """Fresh model wrappers on servers that hold ``job`` at version ``start`` (restored):
    they adopt that version and train on to STEPS."""
    init, data = initial_weights(), batches()
    scrambled = {k: torch.randn_like(v) for k, v in init.items()}  # must not be used

    def rank(client: ShardClient) -> dict:
        model, opt = wrap(strategy, client, job, scrambled)
        assert model.step_count == start
        train_steps(model, opt, client.rank, WORLD, data, range(start, STEPS))
        return model.state_dict()

    return run_ranks(rank, WORLD, addresses)[0]


def single_process(dtype: torch.dtype = torch.float64) -> dict:
    """The same training in plain torch on the whole batch."""
    net = new_gpt(initial_weights(dtype))
    opt = torch.optim.AdamW(net.param_groups(0.1), lr=1e-2)
    data = batches()
    for s in range(STEPS):
        lm_loss(net(data[s, :, :-1]), data[s, :, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return net.state_dict()


def code_of(excinfo: pytest.ExceptionInfo) -> grpc.StatusCode:
    err = excinfo.value
    assert isinstance(err, ShardClientError), repr(err)
    return err.code
