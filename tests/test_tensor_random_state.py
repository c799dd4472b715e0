"""The ranks of a tensor-parallel group draw the same random numbers, or training says so
(strategies/tensor/random_state.py).

A walkthrough's GPT-2 (dropout 0.1) at tp = 2, ranks seeded ``1000 + rank`` after the model
was built, as data-parallel scripts do: the two tensor ranks reported different losses for
one step (5.5704 and 5.5573), their replicated weights drifted 5.3e-3 apart in three steps,
and ``state_dict()`` exported rank 0's copy, without a word. Ranks are processes here (the
launcher's), each with its own generators, as in the field: threads of one process share
torch's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from launching import launch_script

pytestmark = pytest.mark.timeout(240)

SCRIPT = """
import sys, torch
from torch import nn
from paramshard import HybridShardedModel, HybridShardedOptimizer, ShardingConfiguration

config = ShardingConfiguration.from_env(job="dropout")
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(float(sys.argv[2])), nn.Linear(16, 8))
model = HybridShardedModel(net, config, 1, 2, parallelize_plan={"0": "colwise", "2": "rowwise"})
model.default_loss_function = nn.functional.mse_loss
opt = HybridShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
if sys.argv[1] == "apart":
    torch.manual_seed(1000 + config.rank)
x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.zeros(4, 8)
for step in range(2):
    print(f"LOSS {step} {model.train_on_batch(x, y)!r}", flush=True)
"""


def _run(tmp_path: Path, seeds: str, dropout: float) -> tuple[int, str, dict[int, set[str]]]:
    result = launch_script(tmp_path, SCRIPT, seeds, str(dropout))
    losses: dict[int, set[str]] = {}
    for step, loss in re.findall(r"^\[rank \d+\] LOSS (\d+) (\S+)$", result.stdout, re.M):
        losses.setdefault(int(step), set()).add(loss)
    return result.returncode, result.stdout + result.stderr, losses


def test_tensor_ranks_seeded_apart_with_dropout_are_stopped_at_the_first_step(tmp_path) -> None:
    code, output, losses = _run(tmp_path, "apart", 0.5)
    assert code == 1, output[-3000:]
    assert "drew random numbers (dropout) from different generator states" in output, output
    assert not losses, losses  # no step was taken


@pytest.mark.parametrize(("seeds", "dropout"), [("alike", 0.5), ("apart", 0.0)])
def test_tensor_ranks_that_draw_alike_or_not_at_all_train(tmp_path, seeds, dropout) -> None:
    code, output, losses = _run(tmp_path, seeds, dropout)
    assert code == 0, output[-3000:]
    assert sorted(losses) == [0, 1] and all(len(v) == 1 for v in losses.values()), losses
