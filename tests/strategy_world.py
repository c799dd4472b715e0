"""The world the strategy-surface tests train in (tests/test_strategy_surface.py,
tests/test_strategy_training.py, tests/test_mixed_precision.py): the tiny GPT in float64,
two ranks in threads against two in-process shard servers (``addrs``, one pair per test
module), the batches, and single-process AdamW on the whole batch as the reference.

The initial state dict is built once in the main thread (threads share torch's global RNG) and
loaded into every rank's model. Each rank trains on its half of a 4-sample batch, so the
strategies must match single-process training on the whole batch: float64 on both sides,
within 1e-9 (tests/numerics.py).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from paramshard.models.gpt import GPT, Block, GPTConfig, lm_loss
from paramshard.server import ShardServer
from paramshard.strategies import (
    DATA_PARALLEL,
    FSDPModel,
    ShardedModelBase,
    ShardingConfiguration,
)

W = 2
VOCAB = 50
# bias=False as in test_strategies.py: the key part of an attention bias has an exactly zero
# true gradient, and Adam turns its round-off noise into lr-sized steps that no two reduction
# orders agree on.
CFG = GPTConfig.tiny(vocab_size=VOCAB, bias=False)
LR = 1e-2
KINDS = ["ddp", "zero1", "zero2", "fsdp"]
SERVER_KINDS = ["zero1", "zero2", "fsdp"]
_CLASSES = DATA_PARALLEL

_gen = torch.Generator().manual_seed(1234)
X = torch.randint(0, VOCAB, (2 * W, CFG.block_size), generator=_gen)
Y = torch.randint(0, VOCAB, (2 * W, CFG.block_size), generator=_gen)
XV = torch.randint(0, VOCAB, (2, CFG.block_size), generator=_gen)
YV = torch.randint(0, VOCAB, (2, CFG.block_size), generator=_gen)


def rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return X[2 * rank : 2 * rank + 2], Y[2 * rank : 2 * rank + 2]


# -- helpers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", name="addrs")
def addrs_fixture() -> Any:
    """Two servers for a test module (imported there, requested as ``addrs``)."""
    started = [ShardServer("127.0.0.1", 0).start() for _ in range(W)]
    yield [s.address for s in started]
    for s in started:
        s.stop(0)


def init_state(
    cfg: GPTConfig = CFG, seed: int = 0, dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    """Built once, in the main thread; float64 unless asked otherwise."""
    torch.manual_seed(seed)
    return {k: v.to(dtype).clone() for k, v in GPT(cfg).state_dict().items()}


def plain(init: dict[str, torch.Tensor], cfg: GPTConfig = CFG) -> GPT:
    """A GPT in the dtype of ``init``, loaded with it."""
    m = GPT(cfg).to(next(iter(init.values())).dtype)
    m.load_state_dict(init)
    return m


def vec(module: nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(
        [p.detach() for p in module.parameters() if p.requires_grad]
    ).clone()


def reference(
    init: dict[str, torch.Tensor],
    steps: int,
    lr: float = LR,
    cfg: GPTConfig = CFG,
    max_norm: float | None = None,
) -> torch.Tensor:
    """Single-process AdamW on the whole batch, in the dtype of ``init``; ``max_norm`` clips
    the gradient's norm before each step."""
    m = plain(init, cfg)
    opt = torch.optim.AdamW(m.param_groups(0.1), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        lm_loss(m(X), Y).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
        opt.step()
    return vec(m)


def world(
    run_ranks: Callable[..., list[Any]],
    addrs: list[str],
    kind: str,
    fn: Callable[..., Any],
    *,
    init: dict[str, torch.Tensor] | None = None,
    cfg: GPTConfig = CFG,
    with_opt: bool = True,
    lr: float = LR,
    wait_s: float = 60.0,
    **conf: Any,
) -> list[Any]:
    """Runs ``fn(client, model, opt, rank_plain)`` on every rank; results in rank order."""
    init = init if init is not None else init_state(cfg)
    job = f"{kind}-{uuid.uuid4().hex[:10]}"
    model_cls, opt_cls = _CLASSES[kind]

    def per_rank(client: Any) -> Any:
        module = plain(init, cfg)
        config = ShardingConfiguration(client, job=job, timeout_s=20.0, **conf)
        if kind == "fsdp":
            model = FSDPModel(module, config, wrap=(Block,))
        else:
            model = model_cls(module, config)
        opt = None
        if with_opt:
            opt = opt_cls(torch.optim.AdamW(module.param_groups(0.1), lr=lr), config)
        return fn(client, model, opt, plain(init, cfg))

    return run_ranks(per_rank, W, addrs, wait_s=wait_s)


def train_accumulated(model: ShardedModelBase, opt: Any, x: Any, y: Any, steps: int) -> None:
    """``steps`` optimizer steps of two micro-batches each (gradient_accumulation_steps=2)."""
    for _ in range(steps):
        for i in range(2):
            (model.default_loss_function(model(x[i : i + 1]), y[i : i + 1]) / 2).backward()
        opt.step()
        opt.zero_grad()


def steps_of(model: ShardedModelBase) -> int:
    return getattr(model, "step_count", -1)


def names_both_lengths(msg: str, a: int, b: int) -> bool:
    digits = {int(s.replace(",", "")) for s in re.findall(r"\d[\d,]*", msg)}
    return a in digits and b in digits
