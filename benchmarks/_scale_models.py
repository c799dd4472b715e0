"""The models, batches and memory formulas of ``benchmarks.scale``.

Models are Hugging Face ``transformers`` models built from configs (nothing is downloaded),
dropout off (both sides then compute the same function of the same batches):

- ``gpt2-124m``: ``GPT2Config()`` (768 wide, 12 layers, 12 heads, vocabulary 50,257, tied
  head), 124,439,808 parameters;
- ``gpt2-355m``: ``GPT2Config(n_embd=1024, n_layer=24, n_head=16)``, 354,823,168 parameters;
- ``llama-1b``: Llama 3.2 1B's shape with a 32,000-token vocabulary (2048 wide, 16 layers, 32
  heads, 8 key/value heads, MLP 8192, tied head), 1,038,682,112 parameters; FSDP only;
- ``quick``: a 2-layer GPT-2 of 0.1M parameters for ``--quick``.

Compute is float32 everywhere. bfloat16 compute is allowed for the 1B model, but this CPU has
no bfloat16 matrix unit: a 1024 x 1024 matmul measured 0.63 GFLOP/s in bfloat16 against 32.5
in float32 on one core of the 2-core AMD EPYC, so bfloat16 would make the cell 50x slower.

Memory formulas (bytes per process; Ψ parameters, W ranks and W servers, AdamW):

- DDP (ours and torch's): each trainer 16Ψ (parameters, gradients, two moments); servers
  hold no model state;
- ZeRO-1 (ours): trainer 8Ψ (parameters, gradients) + the flat its gradients are pushed
  from; each server 16Ψ/W (master, reduced gradient, two moments);
- ZeRO-2 (ours): trainer 4Ψ (parameters) + its gradient buckets in flight; each server 16Ψ/W.
  Torch's ``ZeroRedundancyOptimizer`` over DDP, the peer of both ZeRO cells (it shards the
  optimizer state only: ZeRO stage 1), keeps parameters and gradients whole: 8Ψ + 8Ψ/W per
  rank (DDP's gradient buckets come on top, not counted);
- FSDP (ours and FSDP2): trainer the gathered units (root + the two largest: computing and
  prefetched, 4 bytes a parameter); each server 16Ψ/W; FSDP2 ranks hold 16Ψ/W + the units.

On top of these each process has its interpreter and libraries (measured at the start of a
run: ``process_overhead``) and a trainer its activations (``activation_bytes``: Korthikanti et
al.'s 34sbh + 5as²b bytes per layer at 2 bytes an element, doubled for float32, plus the
logits and their gradient).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SEED = 1234
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.95), 1e-8, 0.01
ADAMW = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


@dataclass(frozen=True)
class ModelSpec:
    family: str  # "gpt2" or "llama"
    config: dict[str, Any]
    seq_len: int
    batch_per_rank: int
    steps: int  # per run, warm-up included
    warmup: int
    strategies: tuple[str, ...] = ("ddp", "zero1", "zero2", "fsdp")
    worlds: tuple[int, ...] = (2, 4, 8)
    notes: list[str] = field(default_factory=list)


_NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
MODELS: dict[str, ModelSpec] = {
    "quick": ModelSpec(
        "gpt2",
        dict(
            n_embd=64,
            n_layer=2,
            n_head=2,
            vocab_size=512,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
            **_NO_DROPOUT,
        ),
        32,
        2,
        5,
        2,
        worlds=(2,),
    ),
    "gpt2-124m": ModelSpec("gpt2", dict(_NO_DROPOUT), 128, 2, 6, 2),
    "gpt2-355m": ModelSpec(
        "gpt2", dict(n_embd=1024, n_layer=24, n_head=16, **_NO_DROPOUT), 128, 2, 5, 2
    ),
    "llama-1b": ModelSpec(
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            attention_dropout=0.0,
        ),
        128,
        2,
        4,
        1,
        strategies=("fsdp",),
        worlds=(2, 4),
        notes=["float32 compute (bfloat16 matmuls run 50x slower on this CPU)"],
    ),
}


def build(name: str):
    """The model ``name``, its weights drawn from seed ``SEED`` (the same on every rank)."""
    import torch

    spec = MODELS[name]
    torch.manual_seed(SEED)
    if spec.family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(**spec.config))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**spec.config))


def loss_of(model: Any, x: Any) -> Any:
    """The language-model loss of tokens ``x`` (transformers shifts the labels)."""
    return model(input_ids=x, labels=x).loss


def batches(name: str, world: int, steps: int) -> list:
    """``steps`` global batches of W x per-rank sequences of random tokens, seeded per step."""
    import torch

    spec = MODELS[name]
    vocab = spec.config.get("vocab_size", 50257)
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(SEED * 1000 + s)
        out.append(
            torch.randint(0, vocab, (world * spec.batch_per_rank, spec.seq_len), generator=g)
        )
    return out


def shape(name: str) -> dict[str, int]:
    """Width, layers, heads, MLP width and vocabulary of model ``name``."""
    c = MODELS[name].config
    if MODELS[name].family == "gpt2":
        h = c.get("n_embd", 768)
        return dict(
            hidden=h,
            layers=c.get("n_layer", 12),
            heads=c.get("n_head", 12),
            mlp=4 * h,
            vocab=c.get("vocab_size", 50257),
        )
    return dict(
        hidden=c["hidden_size"],
        layers=c["num_hidden_layers"],
        heads=c["num_attention_heads"],
        mlp=c["intermediate_size"],
        vocab=c["vocab_size"],
    )


def activation_bytes(name: str) -> int:
    """A rank's activations in one step (see the module docstring)."""
    spec, m = MODELS[name], shape(name)
    s, b, h, a = spec.seq_len, spec.batch_per_rank, m["hidden"], m["heads"]
    per_layer = 2 * (34 * s * b * h * max(1.0, m["mlp"] / (4 * h)) + 5 * a * s * s * b)
    logits = 4 * s * b * m["vocab"] * 4  # logits, their float32 copy, softmax, gradient
    return int(m["layers"] * per_layer + logits)


def formula(strategy: str, side: str, psi: int, world: int, units: int) -> dict[str, int]:
    """Bytes of model state per trainer and per server (see the module docstring); ``units``
    is 4 bytes x the gathered units' parameters."""
    if strategy == "ddp":
        return {"trainer": 16 * psi, "server": 0}
    if strategy in ("zero1", "zero2") and side == "torch":  # one peer for both
        return {"trainer": 8 * psi + 8 * psi // world, "server": 0}
    if strategy == "zero1":
        return {"trainer": 8 * psi, "server": 16 * psi // world}
    if strategy == "zero2":
        return {"trainer": 4 * psi, "server": 16 * psi // world}
    if side == "torch":
        return {"trainer": 16 * psi // world + units, "server": 0}
    return {"trainer": units, "server": 16 * psi // world}
