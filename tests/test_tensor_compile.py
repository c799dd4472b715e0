"""``torch.compile`` of blocks that hold tensor-parallel layers (torchtitan's form: each block
compiled in place) trains as the eager model does. Dynamo traced into the group's all-reduce
and failed in the client ("Expected np.nditer base, got <class 'memoryview'>", a
walkthrough's pp2 x tp2 run); the collectives are where a compiled region breaks now
(strategies/tensor/communications.py). Ranks are the launcher's processes: dynamo and its
caches are per process.
"""

from __future__ import annotations

import re

import pytest
from launching import launch_script

pytestmark = pytest.mark.timeout(300)

SCRIPT = """
import torch
from torch import nn
from paramshard import HybridShardedModel, HybridShardedOptimizer, ShardingConfiguration

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc, self.out = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.out(torch.relu(self.fc(self.norm(x))))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

x = torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
y = torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
for mode in ("eager", "compiled"):
    config = ShardingConfiguration.from_env(job=mode)
    torch.manual_seed(0)
    net = Net().double()
    if mode == "compiled":
        for b in net.blocks:
            b.compile(backend="aot_eager")
    model = HybridShardedModel(
        net, config, 1, 2, parallelize_plan={"blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}
    )
    model.default_loss_function = nn.functional.mse_loss
    opt = HybridShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    for step in range(3):
        print(f"LOSS {mode} {step} {model.train_on_batch(x, y)!r}", flush=True)
"""


def test_compiled_blocks_with_parallel_layers_train_as_eager_ones(tmp_path) -> None:
    result = launch_script(tmp_path, SCRIPT, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    for mode, _, loss in re.findall(r"^\[rank 0\] LOSS (\w+) (\d+) (\S+)$", result.stdout, re.M):
        losses[mode].append(float(loss))
    assert len(losses["eager"]) == 3, output[-3000:]
    # float64, the same kernels (aot_eager): only the order of additions may differ
    for a, b in zip(losses["compiled"], losses["eager"], strict=True):
        assert abs(a - b) <= 1e-9 * abs(b), losses
