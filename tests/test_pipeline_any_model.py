"""Pipeline parallelism of models we did not write: a transformer with its own names, a root
parameter, a weight tied across stages, two tensors crossing every boundary, keyword inputs,
changing batch and sequence sizes; Hugging Face GPT-2 and Llama built from configs. Float64 on
both sides, against single-process training at tests/numerics.py's bound."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_equivalent
from torch import nn
from torch.utils.checkpoint import checkpoint

from paramshard.strategies.config import ShardingConfiguration
from paramshard.strategies.pipeline import PipelineParallelModel
from paramshard.strategies.pipeline.communications import pack, unpack

VOCAB = 40


class MyBlock(nn.Module):
    """Separate q, k, v projections; takes the position table as a second input."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads  # the head count follows the (local) width
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.norm1(x + pos)
        heads = (f(h).view(B, T, -1, self.head_dim) for f in (self.q, self.k, self.v))
        q, k, v = (t.transpose(1, 2) for t in heads)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        keep = causal & mask[:, None, None, :]
        att = att.masked_fill(~keep, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class MyTransformer(nn.Module):
    """Learned positions as a root parameter, a tied embedding/head, keyword ``mask``."""

    def __init__(self, width: int = 16, heads: int = 2, depth: int = 4, max_len: int = 12) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(max_len, width) * 0.1)
        self.layers = nn.ModuleList(MyBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        mask = torch.ones_like(idx, dtype=torch.bool) if mask is None else mask
        x, pos = self.tok(idx), self.pos[:T]
        for layer in self.layers:
            x = layer(x, pos, mask)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    """Batches whose sizes change from step to step (sequence length and batch size)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        B, T = batch * (1 + i % 2), 6 + 3 * (i % 3)
        x = torch.randint(0, VOCAB, (B, T), generator=g)
        mask = torch.rand(B, T, generator=g) > 0.2
        mask[:, 0] = True
        out.append((x, torch.randint(0, VOCAB, (B, T), generator=g), mask))
    return out


@pytest.mark.equivalence
@pytest.mark.parametrize(
    ("pp", "schedule", "split_points"),
    [
        (2, "1f1b", ["layers.2"]),
        (3, "gpipe", ["layers.1", "layers.3"]),
        (2, "interleaved_1f1b", ["layers.1", "layers.2", "layers.3"]),
        (2, "1f1b", None),  # the default: uniform over the block container
    ],
)
def test_user_transformer_trains_like_a_single_process(
    servers, run_ranks, one_torch_thread, pp, schedule, split_points
):
    torch.manual_seed(0)
    ref = MyTransformer().double()
    initial = copy.deepcopy(ref)
    batches = _batches(4, batch=4)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for x, y, mask in batches:
        opt.zero_grad()
        loss = lm_loss(ref(x, mask=mask), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    addresses = [s.address for s in servers(2)]

    def rank(client):
        model = PipelineParallelModel(
            copy.deepcopy(initial),
            ShardingConfiguration(client),
            micro_batch_count=2,
            schedule=schedule,
            split_points=split_points,
        )
        stage_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for x, y, mask in batches:
            stage_opt.zero_grad()
            # micro-batches of equal size: the loss of a step is their mean (torch's rule)
            losses.append(model.train_step(x, y, lm_loss, mask=mask))
            stage_opt.step()
        return losses, model.gather_full_state_dict(), model.units

    results = run_ranks(rank, pp, addresses)
    expected = ref.state_dict()
    held = [u for _, _, units in results for u in units]
    assert sorted(held) == sorted({*[f"layers.{i}" for i in range(4)], "tok", "norm", "head"})
    for stage, (losses, state, _) in enumerate(results):
        assert_equivalent(losses, ref_losses, f"stage {stage} losses")
        assert list(state) == list(expected)
        assert_equivalent(state, expected, f"stage {stage}")
        # the last stage's copy of the tied weight stayed equal to the embedding
        torch.testing.assert_close(state["head.weight"], state["tok.weight"], rtol=0, atol=0)


def test_forward_through_the_pipeline_gives_the_output_on_the_last_stage(
    servers, run_ranks, one_torch_thread
):
    torch.manual_seed(0)
    ref = MyTransformer().double()
    x, _, mask = _batches(1, batch=3)[0]
    want = ref(x, mask=mask)
    addresses = [s.address for s in servers(1)]

    def rank(client):
        model = PipelineParallelModel(
            copy.deepcopy(ref), ShardingConfiguration(client), 1, split_points=["layers.1"]
        )
        with torch.no_grad():
            return model(x, mask=mask)

    first, last = run_ranks(rank, 2, addresses)
    assert first is None
    torch.testing.assert_close(last, want, rtol=0, atol=0)


class HeadFirst(nn.Module):
    """Registers its head before the blocks but calls it last: stages cannot be cut by
    registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_forward_out_of_registration_order_is_named(servers, run_ranks, one_torch_thread):
    addresses = [s.address for s in servers(1)]

    def rank(client):
        model = PipelineParallelModel(
            HeadFirst(), ShardingConfiguration(client), 1, split_points=["blocks.1"]
        )
        model.train_step(torch.randn(2, 8), torch.randn(2, 3))

    with pytest.raises(RuntimeError, match="'head' of stage 0"):
        run_ranks(rank, 2, addresses, wait_s=20)


class LongSkip(nn.Module):
    """Adds its embedding back at the end: a value that skips over the second stage."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = h = self.inp(x)
        for b in self.blocks:
            h = torch.relu(b(h))
        return self.out(h + e)


@pytest.mark.parametrize(
    ("make", "split", "source"),
    [(LongSkip, "blocks.2", "inp"), (MyTransformer, "layers.1.fc", "layers.1.proj")],
    ids=["skip-over-a-stage", "split-inside-a-block"],
)
def test_a_value_that_crosses_a_split_point_outside_its_arguments_is_named(
    servers, run_ranks, one_torch_thread, make, split, source
):
    """A stage receives the arguments of its first module only. A value made before it and
    used after it (the embedding a skip adds back at the end; the residual around a split
    point inside a block) was the stand-in's zeros on the later stage, silently: the loss was
    4.29 where the model's is 4.37. It is an error naming the module that made it now."""
    addresses = [s.address for s in servers(1)]
    x = torch.randint(0, VOCAB, (2, 6)) if make is MyTransformer else torch.randn(2, 8)

    def rank(client):
        model = PipelineParallelModel(
            make(), ShardingConfiguration(client), 1, split_points=[split]
        )
        out = model(x)
        return None if out is None else out.shape

    with pytest.raises(RuntimeError, match=f"the output of '{source}', a module of an earlier"):
        run_ranks(rank, 2, addresses, wait_s=20)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(h)) + h


class SelfCheckpointed(Residual):
    """Checkpoints itself in ``__call__``, as transformers' GradientCheckpointingLayer."""

    def __call__(self, *args: Any) -> Any:
        return checkpoint(super().__call__, *args, use_reentrant=self.reentrant)


class Checkpointed(nn.Module):
    """Blocks under activation checkpointing, the block's own or its parent's (every block,
    stand-ins too), reentrant or not; returns its embedding too, as an encoder's state is
    carried in a model's output."""

    def __init__(self, form: str, reentrant: bool) -> None:
        super().__init__()
        self.form, self.reentrant = form, reentrant
        self.inp = nn.Linear(4, 8)
        block = SelfCheckpointed if form == "self" else Residual
        self.blocks = nn.ModuleList(block() for _ in range(4))
        for b in self.blocks:
            b.reentrant = reentrant
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = h = self.inp(x)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=self.reentrant) if self.form == "parent" else b(h)
        return self.out(h).sum(), e


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("form", ["self", "parent"])
def test_activation_checkpointing_across_a_split_gives_the_models_gradients(
    servers, run_ranks, one_torch_thread, form, reentrant
):
    """A checkpoint recomputes a stage's first module in backward on the arguments it saved,
    which are the stand-ins' zeros: the gradients were those of zeros (0.08 and 1.30 off,
    silently). The recompute is given what the run received now; the embedding the output
    carries along (a stand-in on the last stage) is not taken for a value computed with."""
    torch.manual_seed(0)
    ref = Checkpointed(form, reentrant).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    ref(x)[0].backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    addresses = [s.address for s in servers(1)]

    def rank(client):
        net = copy.deepcopy(ref)
        net.zero_grad(set_to_none=True)
        model = PipelineParallelModel(
            net, ShardingConfiguration(client), 1, split_points=["blocks.2"]
        )
        model.train_step(x, None, lambda out, y: out[0])
        return {n: p.grad for n, p in net.named_parameters() if p.grad is not None}

    for got in run_ranks(rank, 2, addresses, wait_s=60):
        assert got, "a stage without gradients"
        for name, grad in got.items():
            torch.testing.assert_close(grad, want[name], rtol=1e-12, atol=1e-15, msg=name)


def test_several_tensors_travel_as_one_message():
    ts = [torch.randn(2, 3, dtype=torch.float64), torch.randn(4).bfloat16(), torch.randn(())]
    got = unpack(pack(ts))
    assert [t.dtype for t in got] == [t.dtype for t in ts]
    for a, b in zip(got, ts, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    one = torch.randn(3, 5)
    assert unpack(pack([one]))[0] is not None and pack([one]).dtype == torch.float32
    with pytest.raises(ValueError, match="malformed pipeline message"):
        unpack(torch.tensor([1, 2, 3, 4, 5], dtype=torch.int64))
