"""A model we did not write: Hugging Face GPT-2, built from a config (no download), trained in
float64 by every data-parallel strategy at W=3 equals single-process float64 training at the
contract of tests/numerics.py.

The loss is cross-entropy on ``logits``: transformers' own ``labels=`` loss casts the logits to
float32 (``transformers.loss.loss_utils``), so a float64 run on ``output.loss`` is float32 in
its loss on both sides and differs by float32 round-off (measured ~1e-6), not by ours; the
``labels=`` path is tested in float32, against torch's DDP (tests/test_hf_llama.py).

``train_single`` and ``train_sharded`` are the two sides of every Hugging Face test here and in
tests/test_hf_llama.py and tests/test_checkpoint_compile.py: AdamW with clipping, a model built
by ``build()`` on each rank, ``loss_of(output, tokens)`` from the output of
``model(input_ids=tokens[:, :-1])`` or, with ``labels``, ``model(input_ids=t, labels=t)``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from numerics import assert_equivalent
from test_strategies import STRATEGIES

from paramshard.client import ClusterSpec, ShardClient
from paramshard.server import ShardServer
from paramshard.strategies import ShardingConfiguration

transformers = pytest.importorskip("transformers")
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402

VOCAB, STEPS, WORLD, PER_RANK = 50, 4, 3, 2
CFG = transformers.GPT2Config(
    n_layer=2,
    n_embd=24,
    n_head=2,
    vocab_size=VOCAB,
    n_positions=16,
    bos_token_id=0,
    eos_token_id=0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)


def new_model(init: dict) -> torch.nn.Module:
    model = transformers.GPT2LMHeadModel(CFG).double()
    model.load_state_dict(init)
    return model


def logits_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the ``logits`` of a ``ModelOutput``, in the model's dtype."""
    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )


def labels_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' own loss: ``model(input_ids=t, labels=t).loss`` (it shifts the labels)."""
    return model(input_ids=tokens, labels=tokens).loss


def batches(steps: int = STEPS, batch: int = WORLD * PER_RANK, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (steps, batch, 9), generator=torch.Generator().manual_seed(seed))


def train_single(
    build: Callable[[], torch.nn.Module], data: torch.Tensor, loss_of: Callable = logits_loss
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the whole batch: (losses, state_dict)."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(data.shape[0]):
        loss = loss_of(model, data[s])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def train_sharded(
    strategy: str,
    build: Callable[[], torch.nn.Module],
    data: torch.Tensor,
    loss_of: Callable = logits_loss,
    world: int = WORLD,
    **model_kw: Any,
) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    """The same training by ``strategy`` at ``world`` ranks (threads) on as many fresh
    servers, each rank its equal part of every batch; per rank (losses, state_dict)."""
    servers = [ShardServer().start() for _ in range(world)]
    run, job = uuid.uuid4().hex[:8], f"hf-{uuid.uuid4().hex[:8]}"
    model_cls, opt_cls = STRATEGIES[strategy]
    per_rank = data.shape[1] // world

    def rank(r: int):
        client = ShardClient(
            ClusterSpec([s.address for s in servers]), rank=r, world_size=world, run_id=run
        )
        config = ShardingConfiguration(client, job=job)
        net = build()
        model = model_cls(net, config, **model_kw)
        sharded_opt = opt_cls(torch.optim.AdamW(net.parameters(), lr=1e-2), config)
        losses = []
        for s in range(data.shape[0]):
            loss = loss_of(model, data[s, r * per_rank : (r + 1) * per_rank])
            loss.backward()
            model.clip_grad_norm_(0.5)
            sharded_opt.step()
            sharded_opt.zero_grad()
            losses.append(loss.item())
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        client.close()
        return losses, state

    try:
        with ThreadPoolExecutor(world) as pool:
            futures = [pool.submit(rank, r) for r in range(world)]
            return [f.result(timeout=300) for f in futures]
    finally:
        for s in servers:
            s.stop(0)


def assert_matches_single(
    results: list, want: tuple[list[float], dict[str, torch.Tensor]], what: str
) -> None:
    """Mean loss over ranks and every rank's parameters against single-process, at 1e-9."""
    ref_losses, ref_state = want
    steps = len(ref_losses)
    losses = [sum(r[0][s] for r in results) / len(results) for s in range(steps)]
    assert_equivalent(losses, ref_losses, f"{what} losses")
    for r, (_, state) in enumerate(results):
        assert set(state) == set(ref_state)
        assert_equivalent(state, dict(ref_state), f"{what} rank {r}")


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_hf_gpt2_in_float64_equals_single_process(strategy: str, one_torch_thread) -> None:
    torch.manual_seed(0)
    init = transformers.GPT2LMHeadModel(CFG).double().state_dict()
    data = batches()
    want = train_single(lambda: new_model(init), data)
    wrap = {"wrap": (GPT2Block,)} if strategy == "fsdp" else {}
    results = train_sharded(strategy, lambda: new_model(init), data, **wrap)
    assert_matches_single(results, want, strategy)
