"""A small character-level GPT in the style of nanoGPT (github.com/karpathy/nanoGPT, model.py).

It is the model every strategy is tested and benchmarked on, chosen because it has what makes
sharding interesting: a tied weight (``lm_head.weight`` is ``wte.weight``, Press & Wolf,
arXiv 1608.05859), repeated blocks that make natural FSDP units, and parameters with and
without weight decay. Attention is written as plain matmul + softmax rather than
``scaled_dot_product_attention`` so that CPU results are bit-for-bit reproducible, which the
"same result as plain PyTorch" strategy tests rely on.

The data helpers train on the text of Python's own documentation topics
(``pydoc_data.topics``), so the examples need no download.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paramshard.strategies.tensor.styles import ColwiseParallel, RowwiseParallel

__all__ = [
    "GPTConfig",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "lm_loss",
    "param_groups",
    "load_text",
    "CharTokenizer",
    "get_batch",
    "split_text",
    "generate",
]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. The presets are the sizes the tests and examples use."""

    vocab_size: int
    """Number of distinct tokens (characters here)."""
    block_size: int
    """Longest sequence the model accepts (size of the position embedding)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability; 0 keeps training deterministic."""
    bias: bool = True
    """Whether Linear and LayerNorm layers have biases."""
    tie_weights: bool = True
    """Share the token embedding with the output head (one parameter, reached twice)."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def tiny(cls, **overrides: Any) -> GPTConfig:
        """About 0.1M parameters: fast enough for unit tests. 128 tokens covers ASCII."""
        base = cls(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=64)
        return replace(base, **overrides)

    @classmethod
    def small(cls, **overrides: Any) -> GPTConfig:
        """About 3M parameters: big enough for benchmarks to show communication costs."""
        base = cls(vocab_size=128, block_size=128, n_layer=4, n_head=4, n_embd=256)
        return replace(base, **overrides)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        # q, k and v in one Linear, as GPT-2 does: one matmul, one parameter to shard.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        # Not persistent: it is derived from block_size, so it is neither a parameter to shard
        # nor part of a checkpoint.
        self.register_buffer(
            "mask", mask.view(1, 1, config.block_size, config.block_size), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # The width of q, k and v comes from c_attn's output, not from x: under tensor
        # parallelism c_attn holds only this rank's heads (and n_head counts those).
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        # (B, T, n_head * head_dim) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, -1).transpose(1, 2)
        k = k.view(B, T, self.n_head, -1).transpose(1, 2)
        v = v.view(B, T, self.n_head, -1).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))

    def set_tensor_parallel_heads(self, local_heads: int, head_dim: int) -> None:
        """Under tensor parallelism this rank's ``c_attn`` holds ``local_heads`` heads (the
        plan's ``set_tensor_parallel_heads`` hook, paramshard.strategies.tensor.heads)."""
        self.n_head = local_heads


class MLP(nn.Module):
    """Position-wise feed-forward layer, 4x wider inside."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block; the natural FSDP unit."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm, output head."""

    _tp_plan = {  # tensor parallelism by Megatron's heads (arXiv 1909.08053, §3), as GPT-2's
        "blocks.*.attn.c_attn": ColwiseParallel(packed=3),  # q|k|v in one weight
        "blocks.*.attn.c_proj": RowwiseParallel(),
        "blocks.*.mlp.c_fc": ColwiseParallel(),
        "blocks.*.mlp.c_proj": RowwiseParallel(),
    }
    """The model's own tensor-parallel plan (``default_plan`` reads it, as it reads a Hugging
    Face model's ``_tp_plan``)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            # wte is registered first, so named_parameters() calls the shared tensor
            # "wte.weight" and skips "lm_head.weight".
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's init (std 0.02, zero biases); LayerNorm keeps torch's ones/zeros.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape (B, T, vocab_size) for token ids ``idx`` of shape (B, T)."""
        _, T = idx.shape
        if self.config.block_size < T:
            raise ValueError(
                f"sequence length {T} exceeds GPTConfig.block_size {self.config.block_size}"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def num_params(self) -> int:
        """Number of distinct parameter values (the tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """Optimizer groups of this model's parameters (see ``param_groups``)."""
        return param_groups(self.parameters(), weight_decay)


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Optimizer groups as nanoGPT's configure_optimizers makes them, of any parameters (a
    pipeline stage's, say).

    Matrices (dim >= 2: Linear weights, embeddings) decay; biases and LayerNorm weights
    do not, since shrinking a scale or an offset toward zero is not regularisation.
    """
    params = [p for p in params if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def load_text() -> str:
    """The text of Python's documentation topics, joined in key order (about 0.5 MB).

    It ships with every CPython, so examples and tests train on real prose without a download.
    Its exact content depends on the Python version.
    """
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


class CharTokenizer:
    """Maps each distinct character of a text to an id, in sorted character order."""

    def __init__(self, text: str) -> None:
        self.chars: list[str] = sorted(set(text))
        self.stoi: dict[str, int] = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Ids of ``text`` as a 1-D int64 tensor."""
        try:
            return torch.tensor([self.stoi[ch] for ch in text], dtype=torch.long)
        except KeyError as err:
            raise ValueError(
                f"character {err.args[0]!r} is not in the tokenizer's vocabulary"
            ) from None

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Text of a sequence of ids."""
        return "".join(self.chars[int(i)] for i in ids)


def get_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``data``: inputs x and next-token targets y, each (batch, block).

    The explicit generator lets every rank of a test draw the same (or a deliberately
    different) batch without touching the global RNG.
    """
    if len(data) <= block_size:
        raise ValueError(f"data has {len(data)} tokens; need more than block_size {block_size}")
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    index = starts[:, None] + torch.arange(block_size)
    return data[index], data[index + 1]


def split_text(data: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's split: the first ``1 - val_fraction`` of the tokens train, the rest validate."""
    n = int(len(data) * (1.0 - val_fraction))
    return data[:n], data[n:]


@torch.no_grad()
def generate(
    model: Any,
    tok: CharTokenizer,
    prompt: str,
    n: int,
    block_size: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> str:
    """``n`` characters after ``prompt``: greedy with ``temperature=0``, else sampled from
    softmax(logits / temperature). ``model`` is a plain GPT or a strategy (its ``predict``)."""
    ids = tok.encode(prompt)[None, :]
    forward = getattr(model, "predict", model)
    for _ in range(n):
        logits = forward(ids[:, -block_size:])[:, -1, :]
        if temperature > 0:
            probs = F.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        else:
            nxt = logits.argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return tok.decode(ids[0].tolist())
