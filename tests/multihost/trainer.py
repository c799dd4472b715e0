"""One trainer rank of the multi-host tests (run by ``paramshard launch`` inside a namespace).

FSDP over the shard servers of ``PARAMSHARD_SERVERS`` (RANK, WORLD_SIZE, PARAMSHARD_RUN and
PARAMSHARD_TOKEN come from the launcher) trains a tiny GPT with AdamW and global-norm clipping
on data that is a function of the step number only, so a replayed step sees the same batch.
``--pipeline``: the GPT is cut into one pipeline stage per rank instead
(``HybridShardedModel``, 2 micro-batches), each rank computing its own stage on its own host.
Rank 0 writes ``model.state_dict()`` to ``--out`` (safetensors) and every rank prints one
``RESULT {json}`` line (timings, recoveries).

``--marker-dir D --pause-at K[,K2...]``: every rank writes ``D/rank{R}-step{S}`` when it starts
step S; rank 0, the first time it reaches step K, writes ``D/reached-K`` and waits (at most
120 s) for ``D/go-K``, so the test can break a host exactly mid-training (at each K).

The model, the data and the single-process reference live here too, so the test imports the
very same definitions. The model is float64 (``.double()``), as in every equivalence test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from paramshard.models.gpt import GPT, Block, GPTConfig, lm_loss, param_groups

CFG = GPTConfig.tiny(vocab_size=50, bias=False)
WORLD = 2
BATCH = 4  # global batch; each rank gets BATCH // WORLD rows
SEQ = 16
LR = 3e-3
CLIP = 1.0
PAUSE_LIMIT_S = 120.0


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step``: (BATCH, SEQ + 1) token ids, a function of the step only."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(params, 0.1), lr=LR)


def new_gpt() -> GPT:
    """The trained model: a float64 GPT."""
    return GPT(CFG).double()


def initial_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Initial weights, each tensor its own copy (safetensors refuses the tied ones shared)."""
    torch.manual_seed(seed)
    return {k: v.detach().clone().contiguous() for k, v in new_gpt().state_dict().items()}


def train_single(init: dict[str, torch.Tensor], steps: int) -> dict[str, torch.Tensor]:
    """The reference: one process, the whole batch, plain torch."""
    net = new_gpt()
    net.load_state_dict(init)
    opt = make_optimizer(net.parameters())
    for s in range(steps):
        data = batch(s)
        loss = lm_loss(net(data[:, :-1]), data[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _touch(path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(time.time()))
    os.replace(tmp, path)


def _steps(value: str) -> frozenset[int]:
    return frozenset(int(v) for v in value.split(","))


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import load_file, save_file

    from paramshard.client import ShardClient
    from paramshard.strategies import (
        FSDPModel,
        FSDPOptimizer,
        HybridShardedModel,
        HybridShardedOptimizer,
        ShardingConfiguration,
        train_with_recovery,
    )

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init", required=True, help="initial state dict (safetensors)")
    p.add_argument("--out", required=True, help="final state dict, written by rank 0")
    p.add_argument("--job", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--recovery", action="store_true", help="use train_with_recovery")
    p.add_argument("--pipeline", action="store_true", help="one pipeline stage per rank")
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--retries", type=int, default=5)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--marker-dir", default=None)
    p.add_argument("--pause-at", type=_steps, default=frozenset(), help="steps, comma-separated")
    args = p.parse_args(argv)

    began = time.monotonic()
    client = ShardClient.from_env(retries=args.retries, timeout_s=args.timeout)
    rank, world = client.rank, client.world_size
    if BATCH % world:
        raise SystemExit(f"world size {world} does not divide the batch {BATCH}")
    per = BATCH // world
    config = ShardingConfiguration(client, job=args.job, timeout_s=args.timeout)
    net = new_gpt()
    net.load_state_dict(load_file(args.init))
    if args.pipeline:  # every rank a stage: the whole batch goes through the pipeline
        model = HybridShardedModel(net, config, world, 1, 1, micro_batch_count=2)
        opt = HybridShardedOptimizer(make_optimizer(model.parameters()), config)
    else:
        model = FSDPModel(net, config, wrap=(Block,))
        opt = FSDPOptimizer(make_optimizer(net.parameters()), config)
    markers = Path(args.marker_dir) if args.marker_dir else None
    step_seconds: dict[int, float] = {}  # the step's last run (a replay overwrites)
    first_try: dict[int, float] = {}  # the step's first run, to its end or its failure
    paused: set[int] = set()

    def held(s: int) -> None:
        """Rank 0, the first time at a ``--pause-at`` step: until the test says go."""
        paused.add(s)
        _touch(markers / f"reached-{s}")
        go = markers / f"go-{s}"
        deadline = time.monotonic() + PAUSE_LIMIT_S
        while not go.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {go} within {PAUSE_LIMIT_S:.0f} s")
            time.sleep(0.02)

    def train(s: int) -> float:
        if args.pipeline:
            data = batch(s)
            return model.train_on_batch(data[:, :-1], data[:, 1:], max_grad_norm=CLIP)
        part = batch(s)[rank * per : (rank + 1) * per]
        loss = lm_loss(model(part[:, :-1]), part[:, 1:])
        loss.backward()
        model.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        return loss.item()

    def step(s: int) -> float:
        if markers is not None:
            _touch(markers / f"rank{rank}-step{s}")
            if rank == 0 and s in args.pause_at and s not in paused:
                held(s)
        t0 = time.monotonic()  # a held step's time counts from its release
        try:
            loss = train(s)
        finally:
            first_try.setdefault(s, round(time.monotonic() - t0, 4))
        step_seconds[s] = round(time.monotonic() - t0, 4)
        return loss

    result: dict = {"rank": rank}
    if args.recovery:
        report = train_with_recovery(
            model, step, args.steps, checkpoint_every=args.checkpoint_every, wait_s=60
        )
        result.update(
            recoveries=report.recoveries,
            recovery_seconds=report.recovery_seconds,
            replayed_steps=report.replayed_steps,
            failed_at=report.failed_at,
        )
    else:
        for s in range(args.steps):
            step(s)
    state = model.state_dict()
    if rank == 0:
        tmp = args.out + ".tmp"
        save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, tmp)
        os.replace(tmp, args.out)
    client.barrier()  # rank 1 ends only after rank 0's state_dict gathered from the servers
    client.close()
    result.update(
        elapsed=round(time.monotonic() - began, 3), step_seconds=step_seconds, first_try=first_try
    )
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
