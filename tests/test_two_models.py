"""A script with two models, each with its configuration from the launcher's environment (a
GAN's generator and discriminator, a teacher beside its student), as torch DDP scripts wrap
two models on one process group.

Each ``ShardingConfiguration.from_env`` built a client of its own, both numbering their
collectives from 1 under the run's id: the second model's first broadcast met the first's
slot, freed, and rank 1 ended "behind the other ranks' collectives" at its first step. The
configurations of one process share the client now (client/from_env.py).
"""

from __future__ import annotations

import re

import pytest
from launching import launch_script

pytestmark = pytest.mark.timeout(240)

SCRIPT = """
import torch
from torch import nn
from paramshard import DDPModel, FSDPModel, FSDPOptimizer, ShardingConfiguration

torch.manual_seed(0)
x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
gen_config = ShardingConfiguration.from_env(job="generator")
gen = FSDPModel(nn.Linear(8, 8).double(), gen_config)
gen_opt = FSDPOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1), gen_config)
disc_config = ShardingConfiguration.from_env(job="discriminator")
disc = DDPModel(nn.Linear(8, 1).double(), disc_config)
disc_opt = torch.optim.SGD(disc.parameters(), lr=0.1)
print("SHARED", gen_config.client is disc_config.client, flush=True)
rank = disc_config.rank
for step in range(3):
    fake = gen(x * (rank + 1))
    d_loss = disc(fake.detach()).pow(2).mean()
    d_loss.backward(); disc_opt.step(); disc_opt.zero_grad()
    g_loss = -disc(fake).mean()
    g_loss.backward(); gen_opt.step(); gen_opt.zero_grad(); disc_opt.zero_grad()
w = disc.module.weight.detach().flatten().tolist()
print("DISC", " ".join(repr(v) for v in w), flush=True)
"""


def test_two_models_of_one_script_train_on_their_own_configurations(tmp_path) -> None:
    result = launch_script(tmp_path, SCRIPT, timeout=200)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert re.findall(r"^\[rank \d\] SHARED (\w+)$", result.stdout, re.M) == ["True"] * 2, output
    weights = re.findall(r"^\[rank \d\] DISC (.*)$", result.stdout, re.M)
    assert len(weights) == 2 and weights[0] == weights[1], weights  # DDP's replicas agree
