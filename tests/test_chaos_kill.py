"""The kill half of the chaos suite (slow): servers and trainers SIGKILLed again and again
during training end where an uninterrupted run ends, bit for bit.

1. Server kills: an FSDP job of two ranks with ``train_with_recovery`` (snapshots every EVERY
   steps) on server processes, while ``PARAMSHARD_CHAOS_KILLS`` (default 3) SIGKILLs hit random
   servers at random steps (``PARAMSHARD_CHAOS_SEED``); each is restarted at its address.
2. Trainer kills: ``paramshard launch --max-restarts`` runs a ZeRO-2 job whose ranks SIGKILL
   themselves at random steps of random lives (the same seed); the launcher restarts them, and
   they adopt the servers' step.

Rank-order sums (``deterministic``, the default) make every step reproducible and a replayed
step the same one, so the final parameters are compared with ``torch.equal``. Link flaps are in
tests/multihost (namespaces and veths). Loopback only; every wait is bounded.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_recovery import EVERY, STEPS, cluster_of, initial_state, train  # noqa: F401
from test_trainer_restart import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SEED = int(os.environ.get("PARAMSHARD_CHAOS_SEED", "7"))
KILLS = int(os.environ.get("PARAMSHARD_CHAOS_KILLS", "3"))


def kill_plan(steps: int, kills: int, targets: int, rng: random.Random) -> dict[int, int]:
    """{step: target} for ``kills`` kills at distinct steps, at least 3 steps apart (a kill
    during a recovery is a different test: the recovery's own retries), the targets taking
    turns from a random first one."""
    free = list(range(2, steps - 1, 3))
    first = rng.randrange(targets)
    chosen = sorted(rng.sample(free, min(kills, len(free))))
    return {s: (first + i) % targets for i, s in enumerate(chosen)}


def assert_bitwise(state: dict, ref: dict, what: str) -> None:
    assert state.keys() == ref.keys()
    for name, value in ref.items():
        assert torch.equal(state[name], value), (what, name)


def test_servers_killed_again_and_again(cluster_of):  # noqa: F811
    rng = random.Random(SEED)
    cluster = cluster_of(2)
    addresses = [s.address for s in cluster]
    init = initial_state()
    data = torch.randint(0, 50, (STEPS, 4, 17), generator=torch.Generator().manual_seed(SEED))
    reference = train(addresses, init, data)

    plan = kill_plan(STEPS, KILLS, len(cluster), rng)
    done: list[tuple[int, int, float]] = []
    restarts: list[threading.Thread] = []

    def on_step(step: int) -> None:
        target = plan.get(step)
        if target is None or any(s == step for s, _, _ in done):
            return  # a replayed step is not killed twice
        for t in restarts:  # the previous restart is up before the next kill
            t.join(60)
        began = time.monotonic()
        cluster[target].kill()
        t = threading.Thread(target=cluster[target].start, daemon=True)
        t.start()
        restarts.append(t)
        done.append((step, target, began))

    recovered = train(addresses, init, data, on_step=on_step)
    assert [(s, t) for s, t, _ in done] == list(plan.items())
    for (state, report), (ref_state, _) in zip(recovered, reference, strict=True):
        assert report.recoveries == len(plan), report
        assert "DEADLINE_EXCEEDED" not in report.causes, report.causes
        assert_bitwise(state, ref_state, "killed servers vs uninterrupted")
    print(
        f"[chaos] {len(plan)} server kills at steps {list(plan)} (servers {list(plan.values())});"
        f" recoveries took {[round(x, 2) for x in recovered[0][1].recovery_seconds]} s",
        file=sys.stderr,
    )


TRAIN = r"""
import os, signal, sys
import torch
from paramshard.client import restarts
from paramshard.strategies import ShardingConfiguration, ZeRO2Model, ZeRO2Optimizer

steps, out, plan = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
config = ShardingConfiguration.from_env(job="chaos-" + os.environ["PARAMSHARD_RUN"], timeout_s=90.0)
rank, life = config.rank, restarts.restart_count()
# "rank:life:step:when,...": this rank dies in that life at that step, before or after backward
deaths = {
    (int(r), int(l), int(s)): w for r, l, s, w in (d.split(":") for d in plan.split(",") if d)
}
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
model = ZeRO2Model(net, config)
opt = ZeRO2Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
for step in range(model.step_count, steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    when = deaths.get((rank, life, step))
    if when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    if when == "after":
        model.synchronize_gradients()
        os.kill(os.getpid(), signal.SIGKILL)
    opt.step()
    opt.zero_grad()
if rank == 0:
    torch.save(model.state_dict(), out)
print("DONE", flush=True)
"""


def test_trainers_killed_again_and_again(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    steps = 12
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    lives = {0: 0, 1: 0}
    deaths = []
    for step in kill_plan(steps, KILLS, 2, rng):
        rank = rng.randrange(2)
        deaths.append(f"{rank}:{lives[rank]}:{step}:{rng.choice(['before', 'after'])}")
        lives[rank] += 1
    whole, killed = tmp_path / "whole.pt", tmp_path / "killed.pt"
    base = launch(script, steps, whole, "")
    assert base.returncode == 0, base.stdout[-3000:] + base.stderr[-3000:]
    run = launch("--max-restarts", str(len(deaths)), script, steps, killed, ",".join(deaths))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stderr.count("restarting it") == len(deaths), run.stderr
    assert_bitwise(torch.load(killed), torch.load(whole), "killed trainers vs uninterrupted")
    print(f"[chaos] trainer kills (rank:life:step:when) {deaths}", file=sys.stderr)
