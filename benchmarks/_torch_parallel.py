"""PyTorch's own pipeline, tensor and 3D parallelism on our GPT and on Hugging Face's Llama,
the torch side of ``benchmarks.hybrid`` (one gloo process per rank; the process group is
already up).

- **pipeline**: ``torch.distributed.pipelining.PipelineStage`` over the stage modules of
  ``benchmarks._gpt_stages.split_gpt`` (the same cut as ours), ``ScheduleGPipe`` or
  ``Schedule1F1B`` with ``m`` micro-batches and ``lm_loss``; torch scales the gradients by 1/m
  (``scale_grads=True``), as ours scales each micro-batch's loss.
- **tensor**: DTensor ``parallelize_module`` on every Block. Our ``c_attn`` packs q|k|v in one
  Linear and ours gives each rank its heads' rows of each of q, k and v; a plain
  ``ColwiseParallel`` on ``c_attn`` would instead give rank 0 all of q and part of k, which
  is not head-parallel attention. So the torch side first rewrites each attention as
  ``SplitQKVAttention``: three Linears q, k, v holding the same weights (the arithmetic of
  ``paramshard.models.gpt.CausalSelfAttention``, head count taken from the local width), then shards
  q, k, v with ``ColwiseParallel`` and ``c_proj`` with ``RowwiseParallel``; the MLP's
  ``c_fc`` / ``c_proj`` are Colwise / Rowwise. That is Megatron's split, the same as ours:
  two all-reduces per block forward; backward, one per Colwise module's input gradient, so
  four here against two in ours (its packed ``c_attn`` takes one). Embeddings, layer norms
  and ``lm_head`` stay replicated.
- **3D**: a device mesh (pp, tp, dp) laid out as our ``Topology`` (rank = (pp * tp_size + tp)
  * dp_size + dp), pipelining over the mesh's pp group, DTensor TP over its tp sub-mesh, and
  one flat all-reduce (sum / dp) of the gradients over its dp group before the step.
- **Llama** (``build_llama_cell``): the same at any (pp, tp, dp), over the stage modules of
  ``benchmarks._llama_stages`` and with Llama's own plan in DTensor styles (no rewrite: its
  q, k, v are separate Linears, as in ours; 2 + 5 all-reduces per layer on both sides).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks._gpt_stages import split_gpt
from benchmarks._llama_stages import llama_tensor_parallel, split_llama
from benchmarks._training import adamw
from paramshard.models.gpt import lm_loss


class SplitQKVAttention(nn.Module):
    """``paramshard.models.gpt.CausalSelfAttention`` with ``c_attn`` as three Linears q, k, v (its
    three row blocks, copied), so that ``ColwiseParallel`` on each splits by heads."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        C = attn.c_attn.in_features
        self.head_dim = C // attn.n_head
        has_bias = attn.c_attn.bias is not None
        self.q, self.k, self.v = (nn.Linear(C, C, bias=has_bias) for _ in range(3))
        with torch.no_grad():
            ws = attn.c_attn.weight.chunk(3, 0)
            bs = attn.c_attn.bias.chunk(3, 0) if has_bias else (None,) * 3
            for lin, w, b in zip((self.q, self.k, self.v), ws, bs, strict=True):
                lin.weight.copy_(w)
                if b is not None:
                    lin.bias.copy_(b)
        self.c_proj = attn.c_proj
        self.attn_dropout, self.resid_dropout = attn.attn_dropout, attn.resid_dropout
        self.register_buffer("mask", attn.mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q(x).view(B, T, -1, hd).transpose(1, 2)  # -1: this rank's heads
        k = self.k(x).view(B, T, -1, hd).transpose(1, 2)
        v = self.v(x).view(B, T, -1, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


def tensor_parallel(blocks: Iterable[nn.Module], mesh: Any) -> None:
    """Megatron's split of every Block over the 1-D ``mesh`` with DTensor (see the module
    docstring)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for block in blocks:
        block.attn = SplitQKVAttention(block.attn)
        plan = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(),
        }
        parallelize_module(block, mesh, plan)


def _pipeline(
    stage_mod: nn.Module, index: int, stages: int, m: int, schedule: str, group: Any = None
) -> Callable[[torch.Tensor, torch.Tensor], float | None]:
    """One pipeline step's forward and backward (no optimizer step); returns the batch's
    loss on the last stage, else None."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(stage_mod, index, stages, torch.device("cpu"), group=group)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_microbatches=m, loss_fn=lm_loss)
    first, last = index == 0, index == stages - 1

    def run(x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        if first:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        return float(torch.stack([v.detach() for v in losses]).mean()) if last else None

    return run


def _average_grads(params: list[nn.Parameter], group: Any, size: int) -> None:
    """Mean of the gradients over ``group``: one flat all-reduce of this rank's (local) parts."""
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in local:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def _forward_backward(
    forward: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """One step's forward and backward of a whole (maybe tensor-parallel) model; the loss."""

    def run(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = lm_loss(forward(x), y)
        loss.backward()
        return float(loss.detach())

    return run


def _with_optimizer(
    params: list[nn.Parameter],
    run: Callable[[torch.Tensor, torch.Tensor], float | None],
    group: Any,
    dp: int,
) -> Callable[[torch.Tensor, torch.Tensor], float | None]:
    """A training step: zero_grad, ``run`` (forward and backward), the gradients' mean over
    the data-parallel ``group`` (None: no data parallelism), AdamW's step. The step's
    ``optimizer_s`` is then the last step's seconds after ``run``: the mean and AdamW."""
    opt = adamw(params)

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        opt.zero_grad(set_to_none=True)
        loss = run(x, y)
        t0 = time.perf_counter()
        if group is not None:
            _average_grads(params, group, dp)
        opt.step()
        step.optimizer_s = time.perf_counter() - t0
        return loss

    step.optimizer_s = 0.0
    return step


def build_cell(
    cell: str,
    gpt: nn.Module,
    rank: int,
    world: int,
    sizes: tuple[int, int, int],
    micro_batches: int,
    schedule: str,
    global_batch: int,
) -> tuple[Callable[[torch.Tensor, torch.Tensor], float | None], slice]:
    """``(step, rows)``: ``step(x, y)`` is one training step (zero_grad, forward and backward,
    optimizer step) on this rank's rows ``x[rows]`` of the global batch; it returns the loss
    where this rank has it (the last pipeline stage; every rank without a pipeline)."""
    pp, tp, dp = sizes
    every_row = slice(0, global_batch)
    if cell in ("single", "tp"):
        if cell == "tp":
            from torch.distributed.device_mesh import init_device_mesh

            tensor_parallel(gpt.blocks, init_device_mesh("cpu", (world,)))
        return _with_optimizer(list(gpt.parameters()), _forward_backward(gpt), None, 1), every_row

    if cell in ("pp_gpipe", "pp_1f1b"):
        stage_mod = split_gpt(gpt, world)[rank]
        run = _pipeline(stage_mod, rank, world, micro_batches, schedule)
        group, rows = None, every_row
    elif cell == "3d":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (pp, tp, dp), mesh_dim_names=("pp", "tp", "dp"))
        p, d = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
        stage_mod = split_gpt(gpt, pp)[p]
        tensor_parallel(stage_mod.blocks.values(), mesh["tp"])
        run = _pipeline(stage_mod, p, pp, micro_batches, schedule, group=mesh.get_group("pp"))
        group = mesh.get_group("dp") if dp > 1 else None
        per = global_batch // dp
        rows = slice(d * per, (d + 1) * per)
    else:
        raise ValueError(f"unknown cell {cell!r}")
    return _with_optimizer(list(stage_mod.parameters()), run, group, dp), rows


def build_llama_cell(
    cell: str,
    llama: nn.Module,
    rank: int,
    world: int,
    sizes: tuple[int, int, int],
    micro_batches: int,
    schedule: str,
    global_batch: int,
) -> tuple[Callable[[torch.Tensor, torch.Tensor], float | None], slice]:
    """``build_cell`` for Hugging Face's ``LlamaForCausalLM`` at any (pp, tp, dp) (see
    ``benchmarks._llama_stages``): a mesh (pp, tp, dp) laid out as our ``Topology``;
    pipelining over its pp group when pp > 1 (else the model's own forward, ``.logits``),
    Llama's plan in DTensor styles over its tp sub-mesh when tp > 1, the gradients' mean over
    its dp group when dp > 1."""
    if cell == "single":
        forward = _forward_backward(lambda x: llama(input_ids=x).logits)
        return _with_optimizer(list(llama.parameters()), forward, None, 1), slice(0, global_batch)
    from torch.distributed.device_mesh import init_device_mesh

    pp, tp, dp = sizes
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=("pp", "tp", "dp"))
    p, d = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    module = split_llama(llama, pp)[p] if pp > 1 else llama
    if tp > 1:
        llama_tensor_parallel(module, llama.config, mesh["tp"])
    if pp > 1:
        run = _pipeline(module, p, pp, micro_batches, schedule, group=mesh.get_group("pp"))
    else:
        run = _forward_backward(lambda x: llama(input_ids=x).logits)
    per = global_batch // dp
    group = mesh.get_group("dp") if dp > 1 else None
    return _with_optimizer(list(module.parameters()), run, group, dp), slice(d * per, (d + 1) * per)
