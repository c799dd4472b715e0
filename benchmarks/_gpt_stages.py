"""The example GPT cut into stage modules that map activations to activations, for torch's
own pipelining (``PipelineStage`` needs ``stage(x) -> y``). The cut is the one
``default_split_points`` makes for paramshard's pipeline (uniform: equal block counts, the
embeddings on the first stage, ``ln_f`` + ``lm_head`` on the last), so both sides run the same
layers per stage. The tied head of a last stage that is not also the first is a copy, as in
paramshard and Megatron-LM."""

from __future__ import annotations

import copy

import torch
from torch import nn

from paramshard.models.gpt import GPT
from paramshard.strategies.pipeline import uniform_partition

__all__ = ["GPTStage", "split_gpt"]


class GPTStage(nn.Module):
    """One stage of a GPT: embeddings on the first, ln_f + lm_head on the last."""

    def __init__(self, model: GPT, stage: int, num_stages: int, blocks: range) -> None:
        super().__init__()
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        tied = model.lm_head.weight is model.wte.weight
        if self.is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if self.is_last:
            self.ln_f = model.ln_f
            copy_head = tied and not self.is_first
            self.lm_head = copy.deepcopy(model.lm_head) if copy_head else model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.ln_f(x))
        return x


def split_gpt(model: GPT, num_stages: int) -> list[GPTStage]:
    """The ``num_stages`` stages of ``model`` with equal block counts."""
    ranges = uniform_partition(len(model.blocks), num_stages)
    return [GPTStage(model, s, num_stages, r) for s, r in enumerate(ranges)]
