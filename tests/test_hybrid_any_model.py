"""3D parallelism of models we did not write equals single-process training, float64, 1e-9
(tests/numerics.py): a user transformer with its own names and an explicit plan (the issue's
example), Hugging Face GPT-2 (tied head, packed q|k|v in a Conv1D, the project's plan) and Llama
(grouped-query attention, rotary tables, its config's plan), at (pp, tp, dp) in (2,1,1),
(1,2,1), (2,2,1), (2,1,2); ``x`` as a dict of keyword inputs, outputs as ``ModelOutput``s."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from numerics import assert_equivalent
from test_pipeline_any_model import VOCAB, MyTransformer, lm_loss

from paramshard.client import ClusterSpec, ShardClient
from paramshard.server import ShardServer
from paramshard.strategies import (
    ColwiseParallel,
    HybridShardedModel,
    HybridShardedOptimizer,
    RowwiseParallel,
    ShardingConfiguration,
)

transformers = pytest.importorskip("transformers")

STEPS, BATCH, T = 4, 8, 8
LAYOUTS = [(2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2)]
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.equivalence]

PLAN = {
    "layers.*.q": ColwiseParallel(),
    "layers.*.k": ColwiseParallel(),
    "layers.*.v": ColwiseParallel(),
    "layers.*.proj": RowwiseParallel(),
    "layers.*.fc": ColwiseParallel(),
    "layers.*.out": RowwiseParallel(),
}


def gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=4, n_embd=16, n_head=4, vocab_size=VOCAB, n_positions=T, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=T, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(cfg)


# name -> (model factory, split point of 2 stages, plan, takes keyword inputs)
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], str, dict | None, bool]] = {
    "user": (lambda: MyTransformer(width=16, heads=4), "layers.2", PLAN, False),
    "gpt2": (gpt2, "transformer.h.2", None, True),
    "llama": (llama, "model.layers.2", None, True),
}


def _inputs(model_name: str, x: torch.Tensor) -> dict | torch.Tensor:
    return {"input_ids": x} if MODELS[model_name][3] else x


def _loss(output, y):
    return lm_loss(getattr(output, "logits", output), y)


def single_process(model_name, init, data):
    torch.manual_seed(0)
    model = MODELS[model_name][0]().double()
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(STEPS):
        x = _inputs(model_name, data[s, :, :-1])
        out = model(**x) if isinstance(x, dict) else model(x)
        loss = _loss(out, data[s, :, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def train_hybrid(model_name, layout, init, data):
    pp, tp, dp = layout
    world = pp * tp * dp
    make, split, plan, _ = MODELS[model_name]
    nodes = [ShardServer().start() for _ in range(2)]
    run, job = uuid.uuid4().hex[:6], f"any-{uuid.uuid4().hex[:6]}"

    def rank(r):
        client = ShardClient(
            ClusterSpec([n.address for n in nodes]), rank=r, world_size=world, run_id=run
        )
        config = ShardingConfiguration(client, job=job)
        torch.manual_seed(0)
        net = make().double()
        net.load_state_dict(init)
        model = HybridShardedModel(
            net, config, pp, tp, dp, micro_batch_count=2,
            split_points=[split] if pp > 1 else None, parallelize_plan=plan,
        )  # fmt: skip
        model.default_loss_function = _loss
        HybridShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
        per, d = BATCH // model.data_parallel_size, model.data_parallel_rank
        losses = []
        for s in range(STEPS):
            part = data[s, d * per : (d + 1) * per]
            losses.append(model.train_on_batch(_inputs(model_name, part[:, :-1]), part[:, 1:]))
        return losses, model.state_dict(), len(model.replica.param_splits)

    try:
        with ThreadPoolExecutor(world) as pool:
            return [f.result(timeout=600) for f in [pool.submit(rank, r) for r in range(world)]]
    finally:
        for n in nodes:
            n.stop()


@pytest.fixture(scope="module", params=sorted(MODELS))
def reference(request):
    name = request.param
    torch.manual_seed(0)
    init = MODELS[name][0]().double().state_dict()
    data = torch.randint(
        0, VOCAB, (STEPS, BATCH, T + 1), generator=torch.Generator().manual_seed(1)
    )
    return name, init, data, *single_process(name, init, data)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "x".join(map(str, t)))
def test_any_model_equals_single_process(reference, layout):
    name, init, data, ref_losses, ref_state = reference
    for r, (losses, state, split) in enumerate(train_hybrid(name, layout, init, data)):
        assert (split > 0) == (layout[1] > 1)  # tensor parallelism did split the weights
        assert_equivalent(losses, ref_losses, f"{name} {layout} rank {r} losses")
        assert list(state) == list(ref_state)
        assert_equivalent(state, ref_state, f"{name} {layout} rank {r}")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_labels_loss_of_the_model_output(name):
    """``labels=`` and no ``y``: the last stage takes the output's own ``loss``. transformers
    computes it in float32 even for a float64 model, so the reference runs the same micro-batches
    (m = 2, each loss / m) in one process: the same arithmetic, held to the 1e-9 contract."""
    torch.manual_seed(0)
    make, split, _, _ = MODELS[name]
    init = make().double().state_dict()
    data = torch.randint(0, VOCAB, (2, BATCH, T), generator=torch.Generator().manual_seed(2))
    ref = make().double()
    ref.load_state_dict(init)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for batch in data:
        total = 0.0
        for micro in batch.chunk(2):
            loss = ref(input_ids=micro, labels=micro).loss / 2
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        ref_losses.append(total)

    nodes = [ShardServer().start() for _ in range(2)]
    run, job = uuid.uuid4().hex[:6], f"labels-{uuid.uuid4().hex[:6]}"

    def rank(r):
        client = ShardClient(
            ClusterSpec([n.address for n in nodes]), rank=r, world_size=2, run_id=run
        )
        config = ShardingConfiguration(client, job=job)
        net = make().double()
        net.load_state_dict(init)
        model = HybridShardedModel(net, config, 2, 1, 1, micro_batch_count=2, split_points=[split])
        HybridShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
        losses = [model.train_on_batch({"input_ids": b}, labels=b) for b in data]
        return losses, model.state_dict()

    try:
        with ThreadPoolExecutor(2) as pool:
            results = [f.result(timeout=600) for f in [pool.submit(rank, r) for r in range(2)]]
    finally:
        for n in nodes:
            n.stop()
    for r, (losses, state) in enumerate(results):
        assert_equivalent(losses, ref_losses, f"{name} rank {r} losses")
        assert_equivalent(state, ref.state_dict(), f"{name} rank {r}")
