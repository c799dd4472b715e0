"""Pipeline parallelism: each rank runs only its own stage of the model.

``split_gpt`` cuts a GPT into stages (embeddings + first blocks, ..., last blocks + ln_f +
lm_head); ``PipelineParallelModel`` keeps this rank's stage and runs a schedule
(``strategies/schedules.py``) over micro-batches. Activations travel forward and their
gradients backward through the receivers' server mailboxes (``client.send`` / ``client.recv``),
activations under tag "act" and gradients under "grad"; per pair of ranks and tag, both sides
go in the schedule's order, so the mailboxes' message counters line up. Sends run in the
background and receives are posted ahead of their steps (``_Mailroom``), so transfers overlap
compute on a real cluster.

Tied weights (Megatron-LM, arXiv 2104.04473 §2.1 / ``_allreduce_word_embedding_grads``): with
more than one stage, the last stage holds its own copy of the token embedding for ``lm_head``.
After backward the first and last stage all-reduce the two copies' gradients, so identical
optimizer steps keep the copies identical.

Stage modules keep the whole model's parameter names (``blocks.5.attn.c_attn.weight`` stays
that name on the stage that owns block 5), so ``stage_state_dict`` needs no renaming and
``gather_full_state_dict`` just concatenates the stages' dicts.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import nn

from strategies.config import ShardingConfiguration
from strategies.schedules import (
    ScheduleName,
    build_schedule,
    schedule_name,
    theoretical_bubble_fraction,
)

if TYPE_CHECKING:
    from client import ShardClient
    from examples.gpt import GPT

__all__ = [
    "PartitionName",
    "GPTStage",
    "split_gpt",
    "split_sequential",
    "balanced_partition",
    "uniform_partition",
    "partition_name",
    "UniformPartitionStrategy",
    "LoadBalancedPartitionStrategy",
    "PipelineParallelModel",
]

PartitionName = Literal["uniform", "balanced"]
_PARTITIONS: tuple[str, ...] = get_args(PartitionName)


class UniformPartitionStrategy:
    """Equal block counts per stage (``partition="uniform"``)."""

    name: PartitionName = "uniform"


class LoadBalancedPartitionStrategy:
    """Stages of near-equal parameter cost, the seeds' LoadBalancedPartitionStrategy
    (``partition="balanced"``; see ``balanced_partition``)."""

    name: PartitionName = "balanced"


_PARTITION_ALIASES = {"load_balanced": "balanced", "loadbalanced": "balanced"}


def partition_name(partition: Any) -> PartitionName:
    """ "uniform" or "balanced", from a name (case, '-' and "load_balanced" accepted) or a
    partition strategy class or instance."""
    if isinstance(partition, (UniformPartitionStrategy, LoadBalancedPartitionStrategy)):
        return partition.name
    if isinstance(partition, type) and issubclass(
        partition, (UniformPartitionStrategy, LoadBalancedPartitionStrategy)
    ):
        return partition.name
    if isinstance(partition, str):
        key = partition.lower().replace("-", "_")
        key = _PARTITION_ALIASES.get(key, key)
        if key in _PARTITIONS:
            return key  # type: ignore[return-value]
    raise ValueError(
        f"partition must be one of {', '.join(_PARTITIONS)} (or a partition strategy),"
        f" got {partition!r}"
    )


# -- partitioning ------------------------------------------------------------------------------
def uniform_partition(num_items: int, num_stages: int) -> list[range]:
    """Contiguous ranges of equal size; the first ``num_items % num_stages`` get one more."""
    base, extra = divmod(num_items, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def balanced_partition(costs: list[int], num_stages: int) -> list[range]:
    """Contiguous, non-empty ranges of ``costs`` that minimise the most expensive stage.

    The seeds' LoadBalancedPartitionStrategy idea (balance the stages' parameter cost), solved
    exactly as the linear-partition problem by dynamic programming: ``best[k][j]`` is the
    smallest possible maximum stage cost when the first ``j`` items form ``k`` stages.
    Ties go to the earliest cut, so every rank computes the same partition.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} non-empty pipeline stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    bounds, j = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][j]
        bounds.append(range(i, j))
        j = i
    return bounds[::-1]


def _numel(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


# -- GPT stages --------------------------------------------------------------------------------
class GPTStage(nn.Module):
    """One pipeline stage of a GPT: embeddings on the first, ln_f + lm_head on the last.

    Holds the original model's submodules (no copies) under their original names, except the
    tied ``lm_head`` of a last stage that is not also the first: that is a copy of the
    embedding weight (see the module docstring).
    """

    def __init__(self, model: GPT, stage: int, num_stages: int, blocks: range) -> None:
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.block_size = model.config.block_size
        tied = model.lm_head.weight is model.wte.weight
        self.holds_tied_copy = tied and self.is_last and not self.is_first
        self.has_tied_partner = tied and num_stages > 1 and (self.is_first or self.is_last)
        if self.is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if self.is_last:
            self.ln_f = model.ln_f
            # deepcopy of the head alone clones the shared Parameter: the last stage's copy.
            self.lm_head = copy.deepcopy(model.lm_head) if self.holds_tied_copy else model.lm_head

    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of the tied embedding / output weight, if it has a partner."""
        if not self.has_tied_partner:
            return None
        return self.wte.weight if self.is_first else self.lm_head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            T = x.shape[1]
            if self.block_size < T:
                raise ValueError(
                    f"sequence length {T} exceeds GPTConfig.block_size {self.block_size}"
                )
            x = self.drop(self.wte(x) + self.wpe(torch.arange(T, device=x.device)))
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.ln_f(x))
        return x


def split_gpt(model: GPT, num_stages: int, partition: PartitionName = "uniform") -> list[GPTStage]:
    """The ``num_stages`` stage modules of ``model``; each runs only its own layers.

    - ``uniform``: equal block counts (the first stages take the remainder).
    - ``balanced``: the layer sequence [embeddings, block 0, ..., block n-1, ln_f + lm_head]
      is cut where the stages' parameter counts are most even (``balanced_partition``). The
      embedding (wte + wpe) and the head (ln_f + lm_head, counted even when tied, since the
      last stage computes with and keeps a copy of it) weigh in, so the end stages get fewer
      blocks; they may get none.
    """
    partition = partition_name(partition)
    n = len(model.blocks)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if partition == "uniform":
        if n < num_stages:
            raise ValueError(
                f"uniform partition needs at least one block per stage: {n} blocks,"
                f" {num_stages} stages"
            )
        ranges = uniform_partition(n, num_stages)
    elif num_stages == 1:
        ranges = [range(n)]
    else:
        costs = [_numel(model.wte, model.wpe)]
        costs += [_numel(b) for b in model.blocks]
        costs.append(_numel(model.ln_f) + model.lm_head.weight.numel())
        items = balanced_partition(costs, num_stages)
        # item 0 is the embedding, item n + 1 the head: shift back to block indices
        ranges = [range(max(r.start - 1, 0), min(r.stop - 1, n)) for r in items]
    return [GPTStage(model, s, num_stages, ranges[s]) for s in range(num_stages)]


def split_sequential(
    model: nn.Sequential, num_stages: int, partition: PartitionName = "uniform"
) -> list[nn.Sequential]:
    """Generic fallback: cut an ``nn.Sequential`` by its children (names kept)."""
    partition = partition_name(partition)
    children = list(model.named_children())
    if len(children) < num_stages:
        raise ValueError(f"{len(children)} layers cannot fill {num_stages} pipeline stages")
    if partition == "uniform":
        ranges = uniform_partition(len(children), num_stages)
    else:
        ranges = balanced_partition([_numel(c) for _, c in children], num_stages)
    return [nn.Sequential(OrderedDict(children[i] for i in r)) for r in ranges]


def _split(model: nn.Module, num_stages: int, partition: PartitionName) -> list[nn.Module]:
    if all(hasattr(model, a) for a in ("wte", "wpe", "blocks", "ln_f", "lm_head")):
        return list(split_gpt(model, num_stages, partition))  # type: ignore[arg-type]
    if isinstance(model, nn.Sequential):
        return list(split_sequential(model, num_stages, partition))
    raise TypeError(
        f"PipelineParallelModel can split a GPT or an nn.Sequential, not {type(model).__name__}"
    )


class ChunkedStage(nn.Module):
    """The chunks (virtual stages) one rank holds under the interleaved schedule, as one
    module with the whole model's names: each chunk's submodules are registered here (a GPT's
    ``blocks`` dicts merged), so ``parameters()`` and ``state_dict()`` cover every chunk once.
    ``chunks[c](x)`` runs chunk ``c``; the chunks themselves are not submodules."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        self.chunks = tuple(chunks)
        for chunk in chunks:
            for name, child in chunk.named_children():
                mine = self._modules.get(name)
                if isinstance(mine, nn.ModuleDict) and isinstance(child, nn.ModuleDict):
                    mine.update(child)
                elif mine is None:
                    # a new dict: merging into the chunk's own would make it run every block
                    fresh = nn.ModuleDict(child) if isinstance(child, nn.ModuleDict) else child
                    self.add_module(name, fresh)
                else:
                    raise ValueError(f"two pipeline chunks of one rank both hold '{name}'")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a rank's interleaved chunks run one at a time: call chunks[c](x)")


def _default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for class targets (any leading dims), MSE for float targets."""
    if target.is_floating_point():
        return nn.functional.mse_loss(output, target)
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


_LIKE = torch.empty(0)  # recv template: "give me a torch tensor"


class _Mailroom:
    """A stage's traffic for one schedule: sends go out in the background (one thread, in
    order, like Megatron's isend) and receives are posted ahead, all in the schedule's order
    (one thread), so a tensor is usually here by the time its step needs it. Per sender,
    receiver and tag the order is the schedule's on both sides, which is what the mailboxes'
    message counters need."""

    def __init__(self, pp: Any, pools: tuple[Any, Any], recvs: list[tuple[int, str]]) -> None:
        self.pp, (self._send_pool, recv_pool) = pp, pools
        self._incoming = [recv_pool.submit(pp.recv, src, _LIKE, tag) for src, tag in recvs]
        self._incoming.reverse()  # pop() takes the earliest
        self._sent: list[Any] = []

    def send(self, t: torch.Tensor, dst: int, tag: str) -> None:
        self._sent.append(self._send_pool.submit(self.pp.send, t, dst, tag))

    def recv(self) -> torch.Tensor:
        return self._incoming.pop().result()

    def finish(self) -> None:
        """Waits for every send (raising the first error)."""
        for fut in self._sent:
            fut.result()

    def abandon(self) -> None:
        """After an error: receives not started yet are never posted."""
        for fut in self._incoming:
            fut.cancel()


# -- the pipeline ------------------------------------------------------------------------------
class PipelineParallelModel(nn.Module):
    """This rank's stage of ``model``, trained with a pipeline schedule over micro-batches.

    ``pp_client`` is the pipeline group (its rank is the stage, its size the number of
    stages); it defaults to ``config.client``, a pure pipeline where stage = rank.
    ``parameters()`` are this stage's parameters only, so a plain torch optimizer on them
    works; after ``train_step`` they hold the batch's gradients.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ShardingConfiguration,
        micro_batch_count: int,
        partition: PartitionName = "uniform",
        schedule: ScheduleName = "1f1b",
        pp_client: ShardClient | None = None,
        virtual_stages: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(micro_batch_count, bool) or not isinstance(micro_batch_count, int):
            raise ValueError(f"micro_batch_count must be an int >= 1, got {micro_batch_count!r}")
        if micro_batch_count < 1:
            raise ValueError(f"micro_batch_count must be an int >= 1, got {micro_batch_count}")
        self.config = config
        self.pp = pp_client if pp_client is not None else config.client
        self.pp.deterministic = config.deterministic  # before the tied group copies it
        self.stage_index, self.num_stages = self.pp.rank, self.pp.world_size
        self.micro_batch_count = micro_batch_count
        self.schedule_name = schedule = schedule_name(schedule)
        if virtual_stages is None:
            virtual_stages = 2 if schedule == "interleaved_1f1b" else 1
        if schedule == "interleaved_1f1b" and self.num_stages < 2:
            raise ValueError("the interleaved schedule needs at least 2 pipeline stages")
        self.virtual_stages = virtual_stages
        """Model chunks per rank (the interleaved schedule's v; 1 otherwise)."""
        p, v = self.num_stages, virtual_stages
        self.steps = build_schedule(schedule, p, self.stage_index, micro_batch_count, v)
        # Virtual stage k = c * p + rank: chunk c of rank ``rank`` (plain schedules: k = rank).
        virtual = _split(model, p * v, partition)
        stages = [virtual[r] if v == 1 else ChunkedStage(virtual[r::p]) for r in range(p)]
        # Every rank knows every stage's names and shapes: enough to unpack the all-gather
        # of ``gather_full_state_dict`` without sending any names.
        self._full_keys = list(model.state_dict().keys())
        self._full_param_names = [n for n, _ in model.named_parameters()]
        self._state_layouts = [_layout(s.state_dict()) for s in stages]
        self._grad_layouts = [_layout(dict(s.named_parameters())) for s in stages]
        self.stage = stages[self.stage_index]
        self._chunks = virtual[self.stage_index :: p]
        self.is_first = self.stage_index == 0
        self.is_last = self.stage_index == self.num_stages - 1
        ends = [c for c in (self._chunks[0], self._chunks[-1]) if hasattr(c, "tied_weight")]
        tied = next((w for c in ends if (w := c.tied_weight()) is not None), None)
        self._tied: nn.Parameter | None = tied
        self.tied_group = (
            self.pp.subgroup([0, self.num_stages - 1], "tied-embedding")
            if tied is not None
            else None
        )
        """The first and last stage, which sum the tied embedding's gradient (None without)."""
        self._comm_pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self.last_bubble_fraction: float | None = None
        """Share of the last schedule's wall time this stage spent not computing."""
        self.last_timing: dict[str, float] = {}
        """compute_s, comm_s (waiting for receives and, at the end, for sends) and wall_s of
        the last schedule."""
        self.last_peak_activations = 0
        """Most micro-batches whose activations this stage held at once in the last step."""

    @property
    def theoretical_bubble_fraction(self) -> float:
        """(p - 1) / (v m + p - 1): the schedule's idle share of the wall time (v = 1 but
        for the interleaved schedule)."""
        return theoretical_bubble_fraction(
            self.num_stages, self.micro_batch_count, self.virtual_stages
        )

    @property
    def paper_bubble_ratio(self) -> float:
        """(p - 1) / (v m): the bubble over ideal compute time, as GPipe and Megatron quote it."""
        return (self.num_stages - 1) / (self.virtual_stages * self.micro_batch_count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's layers only (no communication); one chunk per rank only."""
        return self.stage(x)

    # -- training ----------------------------------------------------------------------------
    def train_step(
        self,
        x: torch.Tensor | None,
        y: torch.Tensor | None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> float:
        """Forward and backward of the batch (x, y) through the pipeline; returns the loss.

        The batch is cut into ``micro_batch_count`` equal micro-batches along dim 0; each
        micro-batch's loss is scaled by 1/m, so the accumulated gradients are the whole
        batch's (for a loss that is a mean over the batch). Only the first stage reads ``x``
        and only the last reads ``y``; the last stage broadcasts the loss so every stage
        returns it. Gradients add to existing ``.grad`` like ``loss.backward()``.
        """
        m, p = self.micro_batch_count, self.num_stages
        last_virtual = p * self.virtual_stages - 1
        xs = self._micro_batches(x, "x") if self.is_first else [None] * m
        ys = self._micro_batches(y, "y") if self.is_last else [None] * m
        loss_fn = loss_fn or _default_loss
        # Neighbours on the ring: with chunks, the last rank's chunk c feeds rank 0's c + 1.
        prev, nxt = (self.stage_index - 1) % p, (self.stage_index + 1) % p
        # The tied weight's earlier gradient is set aside so that only this batch's
        # contributions are all-reduced (else both copies' old gradients would be summed).
        stashed = None
        if self._tied is not None:
            stashed, self._tied.grad = self._tied.grad, None

        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        loss_sum, compute, comm, peak = 0.0, 0.0, 0.0, 0
        wall_start = time.perf_counter()
        mail = _Mailroom(self.pp, self._pools(), self._receives)
        try:
            for kind, i, c in self.steps:
                k = c * p + self.stage_index  # the virtual stage
                if kind == "F":
                    if k == 0:
                        inp = xs[i]
                    else:
                        t0 = time.perf_counter()
                        inp = mail.recv()
                        comm += time.perf_counter() - t0
                        if inp.is_floating_point():
                            inp.requires_grad_()
                    t0 = time.perf_counter()
                    out = self._chunks[c](inp)
                    if k == last_virtual:
                        out = loss_fn(out, ys[i]) / m
                        loss_sum += out.item()
                    compute += time.perf_counter() - t0
                    if k != last_virtual:
                        mail.send(out.detach(), nxt, "act")
                    inputs[c, i], outputs[c, i] = inp, out
                    peak = max(peak, len(outputs))
                else:
                    inp, out = inputs.pop((c, i)), outputs.pop((c, i))
                    grad = None
                    if k != last_virtual:
                        t0 = time.perf_counter()
                        grad = mail.recv()
                        comm += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    torch.autograd.backward(out, grad)
                    compute += time.perf_counter() - t0
                    if k != 0:
                        g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
                        mail.send(g, prev, "grad")
            t0 = time.perf_counter()
            mail.finish()
            comm += time.perf_counter() - t0
        except BaseException:
            mail.abandon()
            raise
        wall = time.perf_counter() - wall_start

        self._sync_tied_grad(stashed)
        self.last_timing = {"compute_s": compute, "comm_s": comm, "wall_s": wall}
        self.last_bubble_fraction = 1.0 - compute / wall if wall > 0 else 0.0
        self.last_peak_activations = peak
        if self.num_stages == 1:
            return loss_sum
        loss = self.pp.broadcast(
            torch.tensor([loss_sum], dtype=torch.float64), src=self.num_stages - 1
        )
        return float(loss[0])

    @property
    def _receives(self) -> list[tuple[int, str]]:
        """(source rank, tag) of every tensor this stage receives, in schedule order."""
        p, last = self.num_stages, self.num_stages * self.virtual_stages - 1
        prev, nxt = (self.stage_index - 1) % p, (self.stage_index + 1) % p
        out = []
        for kind, _, c in self.steps:
            k = c * p + self.stage_index
            if kind == "F" and k != 0:
                out.append((prev, "act"))
            elif kind == "B" and k != last:
                out.append((nxt, "grad"))
        return out

    def _pools(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """The send and receive threads, kept for the model's life."""
        if self._comm_pools is None:
            self._comm_pools = (
                ThreadPoolExecutor(1, thread_name_prefix="pp-send"),
                ThreadPoolExecutor(1, thread_name_prefix="pp-recv"),
            )
        return self._comm_pools

    def abandon(self) -> None:
        """After a failed step: a transfer still waiting (a receive from a rank that failed)
        is left to end on its own thread, and the next step gets fresh threads."""
        pools, self._comm_pools = self._comm_pools, None
        for pool in pools or ():
            pool.shutdown(wait=False, cancel_futures=True)

    def _micro_batches(self, t: torch.Tensor | None, what: str) -> list[torch.Tensor]:
        m = self.micro_batch_count
        if t is None:
            raise ValueError(f"stage {self.stage_index} needs {what}, got None")
        if t.shape[0] % m != 0:
            raise ValueError(
                f"batch size {t.shape[0]} of {what} is not divisible by micro_batch_count {m};"
                " equal micro-batches keep the 1/m loss scaling exact"
            )
        return list(t.chunk(m))

    def _sync_tied_grad(self, stashed: torch.Tensor | None) -> None:
        """Megatron's embedding all-reduce: both copies get the sum of both gradients."""
        if self._tied is None or self.tied_group is None:
            return
        w = self._tied
        local = w.grad if w.grad is not None else torch.zeros_like(w)
        total = self.tied_group.all_reduce(local.detach())
        w.grad = total if stashed is None else stashed + total

    # -- state -------------------------------------------------------------------------------
    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's state dict under the whole model's names."""
        return self.stage.state_dict()

    def gather_full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on every rank (collective over the pipeline group).

        The tied ``lm_head.weight`` comes from the last stage's copy (equal to ``wte.weight``).
        """
        got = self._gather(self._state_layouts, self.stage.state_dict())
        return {k: got[k] for k in self._full_keys if k in got}

    def gather_full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient under ``model.named_parameters()`` names, on every rank
        (collective); a missing gradient counts as zeros."""
        grads = {
            n: (p.grad if p.grad is not None else torch.zeros_like(p))
            for n, p in self.stage.named_parameters()
        }
        got = self._gather(self._grad_layouts, grads)
        return {n: got[n] for n in self._full_param_names}

    def _gather(
        self, layouts: list[list[tuple[str, torch.Size, torch.dtype]]], mine: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        """One all-gather per dtype of every stage's tensors, flattened in layout order."""
        out: dict[str, torch.Tensor] = {}
        dtypes = sorted({dt for layout in layouts for _, _, dt in layout}, key=str)
        for dt in dtypes:
            # one spare element: a stage without tensors of this dtype still sends something
            pieces = [t.detach().reshape(-1) for t in mine.values() if t.dtype == dt]
            flat = torch.cat([*pieces, torch.zeros(1, dtype=dt)])
            gathered = [flat] if self.num_stages == 1 else self.pp.all_gather(flat)
            for layout, buf in zip(layouts, gathered, strict=True):
                offset = 0
                for name, shape, d in layout:
                    if d != dt:
                        continue
                    n = shape.numel()
                    out.setdefault(name, buf[offset : offset + n].reshape(shape).clone())
                    offset += n
        return out


def _layout(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Size, torch.dtype]]:
    return [(name, t.shape, t.dtype) for name, t in tensors.items()]
