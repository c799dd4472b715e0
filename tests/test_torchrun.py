"""Trainers started by ``torchrun`` against running shard servers, no ``paramshard launch``.

torchrun sets RANK and WORLD_SIZE, the test sets PARAMSHARD_SERVERS, and the run id comes from
torchrun's ``TORCHELASTIC_RUN_ID`` (a fresh uuid per ``--standalone`` job; client/run_id.py).
Two torchrun jobs train at the same time on the same two in-process servers (the way users
share servers): each must get the same losses and parameters as single-process float64 training
(tests/numerics.py), on both of its ranks, and each job must have its own run id. Every wait is
bounded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from numerics import assert_equivalent

ROOT = Path(__file__).resolve().parents[1]
RUN_S = 300.0  # two torchrun jobs: 2 agents + 4 ranks importing torch on 2 busy cores
STEPS = 6
pytestmark = [pytest.mark.timeout(450), pytest.mark.equivalence]

TRAIN = r"""
import os, sys
import torch
from paramshard.strategies import FSDPModel, FSDPOptimizer, ShardingConfiguration

job, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
config = ShardingConfiguration.from_env(job=job, timeout_s=120.0)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
model = FSDPModel(net.double(), config, wrap=(torch.nn.Linear,))
opt = FSDPOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
losses = []
for step in range(steps):
    g = torch.Generator().manual_seed(1000 * step + config.rank)
    x = torch.randn(8, 16, generator=g, dtype=torch.float64)
    y = torch.randn(8, 4, generator=g, dtype=torch.float64)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
state = {k: v.detach().clone() for k, v in model.state_dict().items()}
torch.save({"run_id": config.client.run_id, "world": config.world_size, "losses": losses,
            "state": state}, f"{out}-{config.rank}.pt")
print(f"DONE rank {config.rank}", flush=True)
"""


def reference(world: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Single-process float64 training on the ranks' batches: per-rank losses, final state."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    net = net.double()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses: list[list[float]] = [[] for _ in range(world)]
    for step in range(STEPS):
        per_rank = []
        for rank in range(world):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(8, 16, generator=g, dtype=torch.float64)
            y = torch.randn(8, 4, generator=g, dtype=torch.float64)
            per_rank.append(torch.nn.functional.mse_loss(net(x), y))
            losses[rank].append(per_rank[-1].item())
        (sum(per_rank) / world).backward()  # data parallelism averages the ranks' gradients
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_two_concurrent_torchrun_jobs_on_shared_servers(servers, tmp_path: Path) -> None:  # noqa: ANN001
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PARAMSHARD_", "TORCHELASTIC_"))
    }
    env.update(
        PARAMSHARD_SERVERS=",".join(s.address for s in servers(2)),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
    )
    jobs = ("torchrun-a", "torchrun-b")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--standalone",
                str(script),
                job,
                str(STEPS),
                str(tmp_path / job),
            ],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for job in jobs
    ]
    try:
        outputs = [p.communicate(timeout=RUN_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-4000:]

    want_losses, want_state = reference(2)
    run_ids = []
    for job in jobs:
        results = [torch.load(tmp_path / f"{job}-{rank}.pt") for rank in (0, 1)]
        assert [r["world"] for r in results] == [2, 2]
        assert results[0]["run_id"] == results[1]["run_id"] not in ("run", "none")
        run_ids.append(results[0]["run_id"])
        for rank, r in enumerate(results):
            assert_equivalent(r["losses"], want_losses[rank], f"{job} rank {rank} losses")
            assert_equivalent(r["state"], want_state, f"{job} rank {rank} parameters")
    assert run_ids[0] != run_ids[1]  # each torchrun job its own TORCHELASTIC_RUN_ID
