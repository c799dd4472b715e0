"""Hugging Face Llama for ``benchmarks.hybrid``: the model (``LlamaForCausalLM`` from a config,
no download), its layouts, its cut into stage modules for torch's own pipelining, and its
tensor-parallel plan in torch's DTensor styles.

- **Model**: ``LLAMA[name]`` sits beside the GPT of the same name in
  ``benchmarks._training.MODELS`` and takes its vocabulary and sequence length, so both
  families train on the same batches. tiny: hidden 256, 4 layers, 4 heads, 2 key/value heads
  (grouped-query attention), intermediate 688, vocabulary 256, untied head, SDPA attention
  (on both sides).
- **Layouts**: the pipeline always has 2 stages (a new one begins at ``model.layers.{L/2}``,
  the cut ours is given as ``split_points``) and tensor parallelism 2 ranks (one key/value
  head each); the rest of the world is data-parallel: pp = (2, 1, W/2), tp = (1, 2, W/2),
  3d = (2, 2, W/4).
- **Stages** (torch's ``PipelineStage`` needs ``stage(x) -> y``): the first stage runs
  ``embed_tokens`` and its layers, the last its layers, ``norm`` and ``lm_head``. Every stage
  computes the causal mask (``create_causal_mask``) and the rotary tables
  (``model.model.rotary_emb``, no parameters) from its input as ``LlamaModel.forward`` does,
  so each layer is called with the same arguments as in the whole model.
- **Plan**: Llama's own (``config.base_model_tp_plan`` plus ``LlamaForCausalLM._tp_plan``, the
  plan ours applies when given none) in torch's styles: ``"colwise"`` -> ``ColwiseParallel()``
  (q, k, v, gate, up), ``"rowwise"`` -> ``RowwiseParallel()`` (o, down),
  ``"colwise_gather_output"`` -> ``ColwiseParallel(output_layouts=Replicate())`` (lm_head).
  Nothing else is adjusted: Llama's attention takes its head count from the width it gets
  (``view(*shape, -1, head_dim)``), and DTensor's default ``use_local_output=True`` hands it
  this rank's local heads as a plain tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from benchmarks._training import MODELS, SEED
from paramshard.strategies.pipeline import uniform_partition

__all__ = [
    "LLAMA",
    "LlamaStage",
    "build_llama",
    "llama_config",
    "llama_info",
    "llama_layout",
    "llama_split_points",
    "llama_tensor_parallel",
    "split_llama",
]

LLAMA: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small": dict(
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
    ),
}
ATTENTION = "sdpa"
STAGES, TENSOR_RANKS = 2, 2


def llama_config(model: str) -> Any:
    """The ``LlamaConfig`` of size ``model`` (vocabulary and positions from the GPT's)."""
    from transformers import LlamaConfig

    gpt = MODELS[model]["overrides"]
    cfg = LlamaConfig(
        **LLAMA[model],
        vocab_size=gpt["vocab_size"],
        max_position_embeddings=gpt["block_size"],
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    cfg._attn_implementation = ATTENTION
    return cfg


def build_llama(model: str) -> nn.Module:
    """A freshly initialised ``LlamaForCausalLM`` of size ``model``, the same on every rank."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    return LlamaForCausalLM(llama_config(model))


def llama_info(model: str) -> dict[str, Any]:
    """The JSON description of size ``model``."""
    cfg = llama_config(model)
    net = build_llama(model)
    keys = ("vocab_size", "max_position_embeddings", "tie_word_embeddings")
    return {
        "config": {**LLAMA[model], **{k: getattr(cfg, k) for k in keys}, "attn": ATTENTION},
        "n_params": sum(p.numel() for p in net.parameters()),
        "split_points": llama_split_points(net, STAGES),
    }


def llama_layout(cell: str, world: int) -> tuple[int, int, int] | str:
    """(pp, tp, dp) of ``cell`` at ``world`` ranks, or why it does not apply."""
    if cell == "3d":
        if world % 4:
            return f"3d = (2, 2, W/4) needs W divisible by 4, not {world}"
        return STAGES, TENSOR_RANKS, world // 4
    if world % 2:
        return f"Llama's {cell} = 2 ranks x W/2 replicas needs an even W, not {world}"
    return (1, TENSOR_RANKS, world // 2) if cell == "tp" else (STAGES, 1, world // 2)


def llama_split_points(model: nn.Module, stages: int) -> list[str]:
    """Where ours begins each stage after the first: equal layer counts, as ``split_llama``."""
    ranges = uniform_partition(len(model.model.layers), stages)
    return [f"model.layers.{r.start}" for r in ranges[1:]]


class LlamaStage(nn.Module):
    """Stage ``stage`` of a ``LlamaForCausalLM``: its decoder layers ``layers``, with
    ``embed_tokens`` on the first stage and ``norm`` + ``lm_head`` on the last. The modules
    are the model's own (no copies); the rotary embedding (no parameters) is on every stage."""

    def __init__(self, model: nn.Module, stage: int, num_stages: int, layers: range) -> None:
        super().__init__()
        self.config = model.config
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        if self.is_first:
            self.embed_tokens = model.model.embed_tokens
        self.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        self.rotary_emb = model.model.rotary_emb
        if self.is_last:
            self.norm, self.lm_head = model.model.norm, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.is_first else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=h,
            attention_mask=None,
            past_key_values=None,
            position_ids=position_ids,
        )
        rotary = self.rotary_emb(h, position_ids=position_ids)
        for layer in self.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids)
        return self.lm_head(self.norm(h)) if self.is_last else h


def split_llama(model: nn.Module, num_stages: int) -> list[LlamaStage]:
    """The ``num_stages`` stages of ``model`` with equal layer counts."""
    ranges = uniform_partition(len(model.model.layers), num_stages)
    return [LlamaStage(model, s, num_stages, r) for s, r in enumerate(ranges)]


def _torch_style(style: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    }
    if style not in styles:
        raise ValueError(f"Llama's plan has style {style!r}; this benchmark knows {list(styles)}")
    return styles[style]()


def llama_tensor_parallel(module: nn.Module, config: Any, mesh: Any) -> None:
    """Llama's own plan (see the module docstring) on ``module`` over the 1-D ``mesh``:
    ``module`` is a ``LlamaForCausalLM`` or a ``LlamaStage`` (its layers under ``layers``);
    entries naming modules it does not hold are left out."""
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import LlamaForCausalLM

    prefix = "model." if isinstance(module, LlamaForCausalLM) else ""
    plan = {prefix + k: v for k, v in config.base_model_tp_plan.items()}
    plan.update(LlamaForCausalLM._tp_plan)
    held = {name for name, _ in module.named_modules()}
    wanted = {k: v for k, v in plan.items() if k.split(".")[0] in held}
    parallelize_module(module, mesh, {k: _torch_style(v) for k, v in wanted.items()})
