"""A model we did not write: Hugging Face GPT-2, built from a config (no download), trained in
float64 by every data-parallel strategy at W=3 equals single-process float64 training at the
contract of tests/numerics.py.

The loss is cross-entropy on ``logits``: transformers' own ``labels=`` loss casts the logits to
float32 (``transformers.loss.loss_utils``), so a float64 run on ``output.loss`` is float32 in
its loss on both sides and differs by float32 round-off (measured ~1e-6), not by ours.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from numerics import assert_equivalent
from test_strategies import STRATEGIES

from client import ClusterSpec, ShardClient
from server import ShardServer
from strategies import ShardingConfiguration

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


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits  # a ModelOutput
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_hf_gpt2_in_float64_equals_single_process(strategy: str, one_torch_thread) -> None:
    torch.manual_seed(0)
    init = transformers.GPT2LMHeadModel(CFG).double().state_dict()
    data = torch.randint(
        0, VOCAB, (STEPS, WORLD * PER_RANK, 9), generator=torch.Generator().manual_seed(1)
    )

    ref = new_model(init)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for s in range(STEPS):
        loss = loss_of(ref, data[s])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())

    servers = [ShardServer().start() for _ in range(WORLD)]
    run, job = uuid.uuid4().hex[:8], f"hf-{uuid.uuid4().hex[:8]}"
    model_cls, opt_cls = STRATEGIES[strategy]

    def rank(r: int):
        client = ShardClient(
            ClusterSpec([s.address for s in servers]), rank=r, world_size=WORLD, run_id=run
        )
        config = ShardingConfiguration(client, job=job)
        net = new_model(init)
        wrap = {"wrap": (GPT2Block,)} if strategy == "fsdp" else {}
        model = model_cls(net, config, **wrap)
        sharded_opt = opt_cls(torch.optim.AdamW(net.parameters(), lr=1e-2), config)
        losses = []
        for s in range(STEPS):
            loss = loss_of(model, data[s, r * PER_RANK : (r + 1) * PER_RANK])
            loss.backward()
            model.clip_grad_norm_(0.5)
            sharded_opt.step()
            sharded_opt.zero_grad()
            losses.append(loss.item())
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        client.close()
        return losses, state

    try:
        with ThreadPoolExecutor(WORLD) as pool:
            results = [f.result(timeout=120) for f in [pool.submit(rank, r) for r in range(WORLD)]]
    finally:
        for s in servers:
            s.stop(0)
    want = ref.state_dict()
    losses = [sum(r[0][s] for r in results) / WORLD for s in range(STEPS)]
    assert_equivalent(losses, ref_losses, f"{strategy} losses")
    for r, (_, state) in enumerate(results):
        assert {n for n, _ in ref.named_parameters()} <= set(state)
        assert_equivalent(state, {k: want[k] for k in state}, f"{strategy} rank {r}")
