"""``train_with_recovery`` recovers a model whose state the servers hold (ZeRO-1/2, FSDP, 3D).
A DDP model keeps its parameters and optimizer state in each trainer: given one, it says so
by name before any step. Before, a field review's DDP script failed on both ranks with
``AttributeError: 'DDPModel' object has no attribute 'registered'``.

Snapshots need servers with a snapshot folder: where they have none, the rank that snapshots
says so and the run ends on every rank at once. Before, every rank recovered as from a lost
server, five times (found writing tests/test_elastic_late_rank.py)."""

from __future__ import annotations

import time

import pytest
import torch
from two_ranks import sgd_step, two_fsdp_ranks

from paramshard.client import ClusterSpec, ShardClient
from paramshard.strategies import DDPModel, ShardingConfiguration, train_with_recovery

pytestmark = pytest.mark.timeout(120)


def test_a_ddp_model_is_refused_by_name_before_any_step(servers) -> None:
    client = ShardClient(ClusterSpec([servers(1)[0].address]), rank=0, world_size=1, run_id="d")
    try:
        model = DDPModel(torch.nn.Linear(4, 2), ShardingConfiguration(client, job="ddp"))
        steps: list[int] = []
        with pytest.raises(TypeError, match=r"whose state the servers hold .* not a DDPModel"):
            train_with_recovery(model, lambda s: steps.append(s) or 0.0, 3)
        assert steps == []
    finally:
        client.close()


def checkpointing(r: int, model, opt) -> object:
    """Six steps, a checkpoint every two."""

    def step(s: int) -> float:
        return sgd_step(model, opt, torch.ones(2, 4))

    return train_with_recovery(model, step, 6, checkpoint_every=2)


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed-world", "elastic"])
def test_servers_without_a_snapshot_folder_end_the_run_at_once(servers, elastic) -> None:
    addresses = [s.address for s in servers(2)]
    began = time.monotonic()
    raised = two_fsdp_ranks(addresses, "nofolder", checkpointing, elastic, timeout_s=20)
    took = time.monotonic() - began
    words = "has no snapshot directory; start the servers with --snapshot-dir"
    assert any(isinstance(e, RuntimeError) and words in str(e) for e in raised.values()), raised
    assert all(words in str(e) for e in raised.values()), raised  # the other: the final notice
    assert took < 20, f"{took:.1f} s"


def test_a_train_token_ends_the_run_at_its_first_checkpoint_saying_which_it_needs(
    servers, tmp_path
) -> None:
    """Checkpoints are admin calls: ranks with the train token of docs/deployment.md stopped
    at step 0 on "Snapshot: PERMISSION_DENIED: Snapshot needs role 'admin'; this token has
    role 'train'", saying nothing of what to do (a field check)."""
    tokens = {"t-train": "train", "t-admin": "admin"}
    addresses = [s.address for s in servers(2, tokens=tokens, snapshot_dir=str(tmp_path))]
    raised = two_fsdp_ranks(addresses, "tok", checkpointing, timeout_s=20, token="t-train")
    words = "are admin calls: give the ranks the servers' admin token"
    assert isinstance(raised[0], PermissionError) and words in str(raised[0]), raised
    assert isinstance(raised[1], Exception) and words in str(raised[1]), raised  # the notice
