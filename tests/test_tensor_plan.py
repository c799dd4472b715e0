"""Tensor parallelism by a plan, for models we did not write, against single-process training.

Each model trains a few AdamW steps in float64 under ``TensorParallelModel`` at tp = 2 (and
uneven splits: heads 2 + 1, features by the slice rule) on real gRPC servers, and must equal
single-process float64 training within 1e-9 (tests/numerics.py): losses, the gathered state
dict (original names and shapes), and a fresh model loading that state dict part by part.

- a transformer of the user's own, with its own names and an explicit plan with wildcards
  (ours, torch's own style instances, Hugging Face's strings);
- Hugging Face GPT-2 with no plan: the project's (packed q|k|v ``Conv1D``);
- Hugging Face Llama with no plan: its config's (GQA, ``lm_head`` gathered or tied).
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_equivalent
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import parallel as torch_tp

from paramshard.strategies import ShardingConfiguration
from paramshard.strategies.tensor import (
    ColumnParallelLinear,
    ColwiseParallel,
    RowwiseParallel,
    TensorParallelModel,
    default_plan,
    parallelize_module,
)
from paramshard.strategies.tensor.plans import matches

transformers = pytest.importorskip("transformers")

VOCAB, STEPS = 50, 4
F64 = torch.float64
equivalence = pytest.mark.equivalence


# -- a transformer of the user's own -------------------------------------------------------------
class MyBlock(nn.Module):
    """Attention and MLP side by side in one module, under names of the user's choosing; the
    head count comes from the local width (``view(B, T, -1, head_dim)``)."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        # No bias on k: softmax ignores a shift of the scores, so its gradient is round-off
        # alone, which Adam would blow up to lr-sized steps in any order of additions.
        self.q, self.v = nn.Linear(width, width), nn.Linear(width, width)
        self.k = nn.Linear(width, width, bias=False)
        self.proj = nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.ln_1(x)
        q, k, v = (
            m(h).view(B, T, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v)
        )
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, -1))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class MyTransformer(nn.Module):
    """Learned positions, and a head tied to the token embedding (it stays replicated)."""

    def __init__(self, width: int = 24, heads: int = 3, hidden: int = 50, layers: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, width), nn.Embedding(16, width)
        self.blocks = nn.ModuleList(MyBlock(width, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def my_plan(flavour: str) -> dict:
    col, row = {
        "ours": (ColwiseParallel(), RowwiseParallel()),
        "torch": (torch_tp.ColwiseParallel(), torch_tp.RowwiseParallel()),
        "hf": ("colwise", "rowwise"),
    }[flavour]
    names = {"q": col, "k": col, "v": col, "proj": row, "fc": col, "out": row}
    return {f"blocks.*.{name}": style for name, style in names.items()}


# -- Hugging Face models, from configs (no download) ---------------------------------------------
def gpt2(heads: int = 2) -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=8 * heads, n_head=heads, vocab_size=VOCAB, n_positions=16,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def llama(heads: int = 4, kv_heads: int = 2, tie: bool = False, hidden: int = 64) -> nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=8 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=hidden, num_hidden_layers=2, vocab_size=VOCAB,
        max_position_embeddings=16, tie_word_embeddings=tie, attn_implementation="eager",
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def logits_of(output):
    return output if isinstance(output, torch.Tensor) else output.logits


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = logits_of(model(tokens[:, :-1]))
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train(model: nn.Module, data: torch.Tensor) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens in data:
        loss = loss_of(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def check_equals_single_process(servers, run_ranks, build, tp_size, plan=None, inspect=None):
    """Trains ``build()`` at tp_size and single-process; compares losses and states, and that a
    fresh tensor-parallel model loading the trained state dict computes the same logits."""
    torch.manual_seed(0)
    init = build().double().state_dict()
    data = torch.randint(VOCAB, (STEPS, 4, 9), generator=torch.Generator().manual_seed(1))
    reference = build().double()
    reference.load_state_dict(init)
    ref_losses = train(reference, data)
    ref_state = reference.state_dict()
    ref_logits = logits_of(reference(data[0, :, :-1])).detach()

    def rank_fn(client):
        net = build().double()
        net.load_state_dict(init)
        config = ShardingConfiguration(client, job="tp-plan")
        model = TensorParallelModel(net, config, parallelize_plan=copy.copy(plan))
        if inspect is not None:
            inspect(model.module, client.rank)
        losses = train(model, data)
        state = model.state_dict()
        fresh = TensorParallelModel(build().double(), config, parallelize_plan=copy.copy(plan))
        fresh.load_state_dict(ref_state)
        return losses, state, logits_of(fresh(data[0, :, :-1])).detach()

    addresses = [s.address for s in servers(2)]
    for rank, (losses, state, logits) in enumerate(run_ranks(rank_fn, tp_size, addresses)):
        assert_equivalent(losses, ref_losses, f"rank {rank} losses")
        assert list(state) == list(ref_state)  # the original names, in order
        assert_equivalent(state, ref_state, f"rank {rank} state")
        assert_equivalent(logits, ref_logits, f"rank {rank} logits after load_state_dict")


# -- training equals single-process --------------------------------------------------------------
@equivalence
@pytest.mark.parametrize(
    "tp_size,flavour", [(2, "ours"), (3, "ours"), (2, "torch"), (2, "hf")]
)  # 3 heads: 2 + 1 at tp=2; 50 MLP features: 17 + 17 + 16 at tp=3
def test_users_transformer_with_a_wildcard_plan(
    servers, run_ranks, one_torch_thread, tp_size, flavour
):
    def inspect(module, rank):
        assert isinstance(module.blocks[1].q, ColumnParallelLinear)
        assert module.head.weight is module.tok.weight  # the tied head stays whole
        if tp_size == 2:
            assert module.blocks[0].q.weight.shape[0] == (16, 8)[rank]  # whole heads of 8

    check_equals_single_process(
        servers, run_ranks, MyTransformer, tp_size, my_plan(flavour), inspect
    )


@equivalence
@pytest.mark.parametrize("heads", [2, 3])  # 3 heads over 2 ranks: 2 + 1
def test_hf_gpt2_with_the_shipped_plan(servers, run_ranks, one_torch_thread, heads):
    def inspect(module, rank):
        attn = module.transformer.h[0].attn
        local = (heads + 1 - rank) // 2
        assert (attn.num_heads, attn.split_size, attn.embed_dim) == (local, 8 * local, 8 * local)
        assert attn.c_attn.weight.shape == (8 * heads, 3 * 8 * local)  # Conv1D: [in, out]

    check_equals_single_process(servers, run_ranks, lambda: gpt2(heads), 2, inspect=inspect)


@equivalence
@pytest.mark.parametrize(
    "tp_size,kwargs",
    [
        (2, {}),  # 4 query heads in 2 GQA groups; lm_head colwise, output gathered
        (2, {"tie": True}),  # lm_head tied to the embedding: replicated
        (2, {"heads": 6, "kv_heads": 3, "hidden": 40}),  # groups 2 + 1 (q heads 4 + 2)
        (3, {"heads": 6, "kv_heads": 3}),  # 64 MLP features 22 + 21 + 21, vocab 17 + 17 + 16
    ],
)
def test_hf_llama_with_its_config_plan(servers, run_ranks, one_torch_thread, tp_size, kwargs):
    def inspect(module, rank):
        attn = module.model.layers[0].self_attn
        q, kv = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        assert q == attn.num_key_value_groups * kv  # each rank keeps whole GQA groups
        tied = kwargs.get("tie", False)
        assert isinstance(module.lm_head, ColumnParallelLinear) != tied

    check_equals_single_process(
        servers, run_ranks, lambda: llama(**kwargs), tp_size, inspect=inspect
    )


# -- plans ---------------------------------------------------------------------------------------
def test_default_plans():
    plan = default_plan(llama())
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"  # prefixed with "model."
    assert plan["lm_head"] == "colwise_gather_output"  # the class's own _tp_plan
    assert "lm_head" not in default_plan(llama(tie=True))  # tied: stays replicated
    plan = default_plan(gpt2())
    assert plan["transformer.h.*.attn.c_attn"] == ColwiseParallel(packed=3)
    assert default_plan(gpt2().transformer)["h.*.mlp.c_proj"] == RowwiseParallel()
    with pytest.raises(
        ValueError, match=r"no tensor-parallel plan .* MyTransformer.*parallelize_plan="
    ):
        default_plan(MyTransformer())


def test_patterns_match_one_atom_per_star():
    assert matches("blocks.*.q", "blocks.0.q") and matches("layers.1*.mlp", "layers.12.mlp")
    assert not matches("blocks.*.q", "blocks.0.attn.q") and not matches("blocks.*", "blocks")


def test_only_leaves_the_other_modules_alone():
    model = MyTransformer()
    group = SimpleNamespace(rank=0, world_size=2)
    parallelize_module(model, group, my_plan("ours"), only=lambda name: name.startswith("blocks.1"))
    assert isinstance(model.blocks[1].fc, ColumnParallelLinear)
    assert isinstance(model.blocks[0].fc, nn.Linear)
    parallelize_module(model, group, {"nothing.*.here": "colwise", "blocks.0.q": "replicate"})
    assert isinstance(model.blocks[0].q, nn.Linear)  # a pattern matching nothing is no error


def test_plan_entries_that_name_no_module_are_said(caplog):
    """A plan with a typo ("block.*.q" for "blocks.*.q") trained at tp = 2 splitting nothing
    (a walkthrough's model: 19,648 parameters a rank where the plan meant 11,296), silently;
    torch's parallelize_module warns. Entries naming no module are warned about now, with the name
    they may have meant; a plan of which no entry names one is an error."""
    group = SimpleNamespace(rank=0, world_size=2)
    typo = {k.replace("blocks", "block"): v for k, v in my_plan("ours").items()}
    with pytest.raises(ValueError, match=r"'block\.\*\.q' \(did you mean 'blocks\.\*\.q'\?\)"):
        parallelize_module(MyTransformer(), group, typo)
    model = MyTransformer()
    with caplog.at_level("WARNING", logger="paramshard.strategies.tensor.plans"):
        parallelize_module(model, group, {**my_plan("ours"), "blocks.*.gate": "colwise"})
    assert "'blocks.*.gate'" in caplog.text and "split nothing" in caplog.text, caplog.text
    assert isinstance(model.blocks[0].fc, ColumnParallelLinear)  # the other entries apply


# -- errors --------------------------------------------------------------------------------------
def test_unknown_styles_are_named():
    group = SimpleNamespace(rank=0, world_size=2)
    with pytest.raises(
        ValueError,
        match=r"'blocks.\*.q': unknown .* style 'sequence_parallel'; known: colwise, colwise_gat",
    ):
        parallelize_module(MyTransformer(), group, {"blocks.*.q": "sequence_parallel"})
    torch_style = torch_tp.RowwiseParallel(output_layouts=Shard(1))
    with pytest.raises(
        ValueError,
        match=r"RowwiseParallel with input_layouts=shard\(-1\), output_layouts=shard\(1\) is not",
    ):
        parallelize_module(MyTransformer(), group, {"blocks.*.out": torch_style})
    gathered = torch_tp.ColwiseParallel(output_layouts=Replicate())  # = gather_output
    parallelize_module(model := MyTransformer(), group, {"blocks.*.fc": gathered})
    assert model.blocks[0].fc.gather_output


class StaleAttention(nn.Module):
    """Keeps its head count and uses it: split by a plan, it would compute garbage."""

    def __init__(self, width: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.n_head, self.hidden_size = heads, width
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))


def test_a_stale_head_count_is_named():
    plan = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise"}
    model = nn.ModuleDict({"attn": StaleAttention()})
    with pytest.raises(
        ValueError,
        match=r"attn.n_head = 4 \(this rank holds 2\); attn.hidden_size = 16 \(this rank holds 8\)"
        r": .*StaleAttention",
    ):
        parallelize_module(model, SimpleNamespace(rank=0, world_size=2), plan)


def test_a_tied_module_in_an_explicit_plan_is_refused():
    with pytest.raises(ValueError, match=r"'head' shares its weight with 'tok.weight' \(tied\)"):
        parallelize_module(
            MyTransformer(), SimpleNamespace(rank=0, world_size=2), {"head": "colwise"}
        )


def test_gqa_groups_that_cannot_be_split_are_named():
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.self_attn: 2 key/value head group\(s\) cannot be split over"
        r" tensor_parallel_size=3",
    ):
        parallelize_module(llama(), SimpleNamespace(rank=0, world_size=3))


def test_layers_reading_one_input_share_one_backward_all_reduce(servers, run_ranks):
    """q, k and v read the same hidden states, gate and up too: one ``f`` each, so backward
    all-reduces once per attention, once per MLP and once for ``lm_head`` (2 layers: 5), not
    once per column-parallel layer (11). Forward: ``o_proj`` and ``down_proj`` (4)."""
    data = torch.randint(VOCAB, (1, 2, 9), generator=torch.Generator().manual_seed(1))

    def rank_fn(client):
        torch.manual_seed(0)
        model = TensorParallelModel(llama().double(), ShardingConfiguration(client, job="f"))
        calls = []
        all_reduce = client.all_reduce

        def counted(*args, **kwargs):
            calls.append(torch.is_grad_enabled())  # autograd runs backward without grad mode
            return all_reduce(*args, **kwargs)

        client.all_reduce = counted
        loss = loss_of(model, data[0])
        forward = len(calls)
        loss.backward()
        return forward, len(calls) - forward, model.module.model.layers[0].self_attn.q_proj

    for forward, backward, q_proj in run_ranks(rank_fn, 2, [s.address for s in servers(1)]):
        assert isinstance(q_proj, ColumnParallelLinear)
        assert (forward, backward) == (4, 5)
