"""Trainer memory for parameters with ``param_dtype="bfloat16"`` against float32, in one run.

    python -m benchmarks.mixed_precision [--model tiny|small] [--world-size 2] [--steps 3]

For each strategy (DDP, ZeRO-1, ZeRO-2, FSDP wrapping each ``Block``) the same GPT trains
``--steps`` steps twice on W ranks (threads, one in-process ``ShardServer`` per rank): once at
the defaults (float32 compute) and once with bfloat16 compute. Reported per rank 0, in bytes:

- ``fsdp``: the peak of gathered parameter bytes alive at once (``model.peak_live_bytes``: the
  strategy adds the bytes of the distinct storages a unit's parameters hold when it gathers
  the unit and subtracts them when it frees it);
- ``zero1`` / ``zero2``: the bytes of the replica the trainer keeps (the working copy);
- ``ddp``: the peak of parameter bytes during forward and backward (float32 parameters plus
  their bfloat16 working copy), sampled by a forward hook on every module.

Why not tracemalloc or RSS: torch allocates tensors in C++, which ``tracemalloc`` does not see,
and the process's RSS also holds the in-process servers, the allocator's caches and the
activations, so neither isolates the parameters. Counting the storages the parameters hold is
exact and the same on every machine.

JSON goes to stdout: per strategy the float32 and bfloat16 bytes and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import Any

MODELS = {
    "tiny": dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128),
    "small": dict(vocab_size=4096, block_size=128, n_layer=6, n_head=6, n_embd=384),
}
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")


def run(strategy: str, model_name: str, world: int, steps: int, param_dtype: str | None) -> int:
    """Rank 0's measured parameter bytes (see the module docstring) for one configuration."""
    import torch

    from paramshard.client import ClusterSpec, ShardClient
    from paramshard.models.gpt import GPT, Block, GPTConfig, lm_loss
    from paramshard.server import ShardServer
    from paramshard.strategies import (
        DATA_PARALLEL,
        ShardingConfiguration,
    )
    from paramshard.strategies.data_parallel.fsdp import held_bytes

    classes = DATA_PARALLEL
    cfg = GPTConfig.tiny(**MODELS[model_name], tie_weights=False)
    torch.manual_seed(0)
    init = GPT(cfg).state_dict()
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (2 * world, cfg.block_size), generator=gen)
    servers = [ShardServer("127.0.0.1", 0).start() for _ in range(world)]
    job, run_id = f"mp-{strategy}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex[:8]
    clients = [
        ShardClient(ClusterSpec([s.address for s in servers]), rank=r, world_size=world,
                    run_id=run_id, timeout_s=60.0)
        for r in range(world)
    ]  # fmt: skip

    def rank(client: Any) -> int:
        module = GPT(cfg)
        module.load_state_dict(init)
        config = ShardingConfiguration(client, job=job, param_dtype=param_dtype, timeout_s=60.0)
        model_cls, opt_cls = classes[strategy]
        wrap = {"wrap": (Block,)} if strategy == "fsdp" else {}
        model = model_cls(module, config, **wrap)
        opt = opt_cls(torch.optim.AdamW(module.parameters(), lr=1e-3), config)
        params = list(module.parameters())
        peak = [0]

        def sample(*_: Any) -> None:  # DDP: float32 parameters and the working copy
            aside = list(getattr(model, "_full_precision", {}).values())
            peak[0] = max(peak[0], held_bytes(params + aside))

        if strategy == "ddp":
            for m in module.modules():
                m.register_forward_hook(sample)
        rows = slice(2 * client.rank, 2 * client.rank + 2)
        for _ in range(steps):
            loss = lm_loss(model(x[rows]).float(), x[rows])
            loss.backward()
            opt.step()
            opt.zero_grad()
        if strategy == "fsdp":
            return model.peak_live_bytes
        if strategy == "ddp":
            return peak[0]
        return held_bytes(params)

    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(world) as pool:
            results = list(pool.map(rank, clients, timeout=600))
        return results[0]
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.stop(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    rows = {}
    for strategy in STRATEGIES:
        fp32 = run(strategy, a.model, a.world_size, a.steps, None)
        bf16 = run(strategy, a.model, a.world_size, a.steps, "bfloat16")
        rows[strategy] = {
            "float32_bytes": fp32,
            "bfloat16_bytes": bf16,
            "ratio": round(bf16 / fp32, 4),
        }
        print(f"{strategy}: {rows[strategy]}", file=sys.stderr)
    measured = {
        "fsdp": "peak gathered parameter bytes",
        "zero1": "replica (working copy) bytes",
        "zero2": "replica (working copy) bytes",
        "ddp": "peak parameter bytes in forward (float32 + working copy)",
    }
    out = {
        "model": a.model,
        "world_size": a.world_size,
        "steps": a.steps,
        "measured": measured,
        "strategies": rows,
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
