"""``PipelineParallelModel``: each rank runs only its own stage(s) of any ``nn.Module``.

The model is cut at module boundaries (``split.py``: at ``split_points``, or where the
partition puts them in the model's block container, ``partition.py``), and a schedule
(``schedules.py``) runs the micro-batches through the stages; activations and their gradients
travel through the receivers' server mailboxes (``communications.py``).

Every stage of a pipeline is given the same batch (each runs the code before its first module
on the real inputs); only the last uses the targets. The loss of a step is the mean of the
micro-batch losses, as in torch's pipelining.

Tied weights (Megatron-LM, arXiv 2104.04473 §2.1 / ``_allreduce_word_embedding_grads``): a
weight used by modules of several ranks (a tied embedding and head) is kept by each of them;
after backward those ranks all-reduce its gradient, so identical optimizer steps keep the
copies identical.

Stage modules keep the whole model's parameter names (``blocks.5.attn.c_attn.weight`` stays
that name on the rank that owns block 5), so ``gather_full_state_dict`` just concatenates the
ranks' dicts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from paramshard.strategies.config import ShardingConfiguration
from paramshard.strategies.losses import default_loss
from paramshard.strategies.pipeline.batches import call_args, micro_batches
from paramshard.strategies.pipeline.communications import (
    RECV_LIKE,
    Mailroom,
    new_pools,
    pack,
    unpack,
)
from paramshard.strategies.pipeline.layouts import gather, layout_of
from paramshard.strategies.pipeline.materialize import InitWeights, WeightInit
from paramshard.strategies.pipeline.partition import PartitionName, default_split_points
from paramshard.strategies.pipeline.schedules import (
    ScheduleName,
    build_schedule,
    schedule_name,
    theoretical_bubble_fraction,
)
from paramshard.strategies.pipeline.split import plan_stages
from paramshard.strategies.pipeline.stages import RankStages
from paramshard.strategies.topology import ring_neighbours

if TYPE_CHECKING:
    from paramshard.client import ShardClient

__all__ = ["PipelineParallelModel"]


class PipelineParallelModel(nn.Module):
    """This rank's stage of ``model``, trained with a pipeline schedule over micro-batches.

    ``pp_client`` is the pipeline group (its rank is the stage, its size the number of
    stages); it defaults to ``config.client``. ``split_points`` name the modules where stages
    begin (``p * v - 1`` of them with ``v`` chunks per rank); without them ``partition``
    places them. ``parallelize(model, owns)`` runs before the split with a predicate on module
    names saying which modules this rank keeps (tensor parallelism goes there).
    ``init_weights`` (with ``init_seed`` for a seeded one) makes a model built on the meta
    device real on this rank for its own stage and tensor parts only, from a state dict, a
    safetensors checkpoint or a replayed init (``materialize.py``); None keeps the model's own.
    ``init_device`` (torchtitan's name) is where those tensors then live, e.g. "cuda" (default:
    the CPU); they are set on the CPU first, so a seeded init draws what a CPU build draws.
    ``parameters()`` are this rank's only, so a plain torch optimizer on them works; after
    ``train_step`` they hold the batch's gradients.
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
        *,
        split_points: list[str] | None = None,
        parallelize: Callable[[nn.Module, Callable[[str], bool]], Any] | None = None,
        init_weights: InitWeights = None,
        init_seed: int | None = None,
        init_device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(micro_batch_count, bool) or not isinstance(micro_batch_count, int):
            raise ValueError(f"micro_batch_count must be an int >= 1, got {micro_batch_count!r}")
        if micro_batch_count < 1:
            raise ValueError(f"micro_batch_count must be an int >= 1, got {micro_batch_count}")
        weights = WeightInit(model, init_weights, init_seed)  # a meta copy, before TP
        self.config = config
        self.pp = pp_client if pp_client is not None else config.client
        self.pp.deterministic = config.deterministic  # before the tied groups copy it
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
        if split_points is None:
            split_points = default_split_points(model, p * v, partition)
        elif len(split_points) != p * v - 1:
            raise ValueError(
                f"{p} pipeline stages x {v} chunks need {p * v - 1} split_points,"
                f" got {len(split_points)}: {list(split_points)}"
            )
        self.plan = plan_stages(model, split_points)
        # Every rank knows every rank's names and shapes: enough to unpack the all-gather of
        # ``gather_full_state_dict`` without sending any names.
        state = model.state_dict()
        self.full_keys = list(state)
        """The whole model's state dict keys, in its order."""
        self._full_param_names = [n for n, _ in model.named_parameters()]
        self._state_layouts = [layout_of(state.items(), self.plan, p, r) for r in range(p)]
        named = list(model.named_parameters(remove_duplicate=False))
        self._grad_layouts = [layout_of(named, self.plan, p, r, dedupe=True) for r in range(p)]
        first_name = {id(q): n for n, q in model.named_parameters()}
        self._use_cache = getattr(getattr(model, "config", None), "use_cache", None) is not None
        rank = RankStages(model, self.plan, self.stage_index, p)
        if parallelize is not None:
            parallelize(model, rank.owns)
        rank.build()
        # after TP, before the servers see it
        weights.materialize(self.plan, rank.module, init_device)
        self.stage = rank.module
        self._runners = rank.runners
        self.units = sorted(rank.units)
        """Names of the modules this rank runs (its units)."""
        self.is_first = self.stage_index == 0
        self.is_last = self.stage_index == self.num_stages - 1
        self.tied_groups = self._tied_groups(rank, first_name)
        """(group client, params) per set of ranks that share weights; their gradients are
        summed over the group after backward."""
        self.copies = {
            id(q) for q in self.stage.parameters() if rank.param_holders[id(q)][0] != self.pp.rank
        }
        """ids of this rank's copies of weights an earlier rank holds (counted once, there)."""
        self._comm_pools: Any = None
        self.last_bubble_fraction: float | None = None
        """Share of the last schedule's wall time this stage spent not computing."""
        self.last_timing: dict[str, float] = {}
        """compute_s, comm_s (waiting for receives and, at the end, for sends) and wall_s of
        the last schedule."""
        self.last_peak_activations = 0
        """Most micro-batches whose activations this stage held at once in the last step."""

    def _tied_groups(self, rank: RankStages, first_name: dict[int, str]) -> list[tuple[Any, list]]:
        original = {id(c): i for i, c in rank.clones.items()}
        by_holders: dict[tuple[int, ...], list[tuple[str, nn.Parameter]]] = {}
        for q in self.stage.parameters():
            holders = rank.param_holders[id(q)]
            if len(holders) > 1:
                name = first_name[original.get(id(q), id(q))]
                by_holders.setdefault(holders, []).append((name, q))
        groups = []
        for holders in sorted(by_holders):
            client = self.pp.subgroup(list(holders), "tied-" + "-".join(map(str, holders)))
            groups.append((client, [q for _, q in sorted(by_holders[holders])]))
        return groups

    @property
    def tied_group(self) -> Any:
        """The first tied group's client (the embedding group), or None."""
        return self.tied_groups[0][0] if self.tied_groups else None

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

    def forward(self, x: Any = None, **inputs: Any) -> Any:
        """The whole model's forward through the pipeline, without backward (collective over
        the pipeline group): the last stage returns the output, the others None."""
        p, last = self.num_stages, self.num_stages * self.virtual_stages - 1
        args, kwargs = call_args(x, inputs, self._use_cache)
        out = None
        with torch.enable_grad():  # activations are the tensors that need gradients
            for c, runner in enumerate(self._runners):
                k = c * p + self.stage_index
                prev = ring_neighbours(self.stage_index, p)[0]
                received = [] if k == 0 else self._arrived(self.pp.recv(prev, RECV_LIKE, "fwd"))
                sent, out = runner.run(args, kwargs, received)
                if k != last:
                    self.pp.send(pack(sent), ring_neighbours(self.stage_index, p)[1], "fwd")
        return _detach(out) if self.is_last else None

    # -- training ----------------------------------------------------------------------------
    def train_step(
        self,
        x: Any,
        y: torch.Tensor | None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        **inputs: Any,
    ) -> float:
        """Forward and backward of the batch (x, y) through the pipeline; returns the loss.

        ``x`` is a tensor (the model's first argument) or a dict of keyword inputs; ``inputs``
        are more keyword inputs. Every tensor whose first dim is the batch size is cut into
        ``micro_batch_count`` equal micro-batches; each micro-batch's loss is scaled by 1/m, so
        the accumulated gradients are the whole batch's (for a loss that is a mean over the
        batch). Every stage needs the inputs; only the last reads ``y`` (None: the output's
        own ``loss``). Gradients add to existing ``.grad`` like ``loss.backward()``.
        """
        m, p = self.micro_batch_count, self.num_stages
        last_virtual = p * self.virtual_stages - 1
        batches = micro_batches(
            call_args(x, inputs, self._use_cache),
            y,
            self.micro_batch_count,
            self.stage_index,
            self.is_last,
        )
        loss_fn = loss_fn or default_loss
        prev, nxt = ring_neighbours(self.stage_index, p)
        # Shared weights' earlier gradients are set aside so that only this batch's
        # contributions are all-reduced (else every copy's old gradient would be summed).
        stashed = [[q.grad for q in params] for _, params in self.tied_groups]
        for _, params in self.tied_groups:
            for q in params:
                q.grad = None

        inputs_of: dict[tuple[int, int], list[torch.Tensor]] = {}
        outputs_of: dict[tuple[int, int], list[torch.Tensor]] = {}
        loss_sum, compute, comm, peak = 0.0, 0.0, 0.0, 0
        wall_start = time.perf_counter()
        mail = Mailroom(self.pp, self._pools(), self._receives)
        try:
            for kind, i, c in self.steps:
                k = c * p + self.stage_index  # the virtual stage
                if kind == "F":
                    received: list[torch.Tensor] = []
                    if k != 0:
                        t0 = time.perf_counter()
                        received = self._arrived(mail.recv())
                        comm += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    args, kwargs, target = batches[i]
                    sent, out = self._runners[c].run(args, kwargs, received)
                    if k == last_virtual:
                        loss = loss_fn(out, target) / m
                        loss_sum += loss.item()
                        sent = [loss]
                    compute += time.perf_counter() - t0
                    if k != last_virtual:
                        mail.send(sent, nxt, "act")
                    inputs_of[c, i], outputs_of[c, i] = received, sent
                    peak = max(peak, len(outputs_of))
                else:
                    received, sent = inputs_of.pop((c, i)), outputs_of.pop((c, i))
                    grads = None
                    if k != last_virtual:
                        t0 = time.perf_counter()
                        grads = self._arrived(mail.recv(), grad=False)
                        comm += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    torch.autograd.backward(sent, grads)
                    compute += time.perf_counter() - t0
                    if k != 0:
                        mail.send([_grad_of(t) for t in received], prev, "grad")
            t0 = time.perf_counter()
            mail.finish()
            comm += time.perf_counter() - t0
        except BaseException:
            mail.abandon()
            raise
        wall = time.perf_counter() - wall_start

        self._sync_tied_grads(stashed)
        self.last_timing = {"compute_s": compute, "comm_s": comm, "wall_s": wall}
        self.last_bubble_fraction = 1.0 - compute / wall if wall > 0 else 0.0
        self.last_peak_activations = peak
        if self.num_stages == 1:
            return loss_sum
        # the last virtual stage, p * v - 1, is always on the last rank
        loss_t = self.pp.broadcast(torch.tensor([loss_sum], dtype=torch.float64), src=p - 1)
        return float(loss_t[0])

    def _arrived(self, tensors: Any, grad: bool = True) -> list[torch.Tensor]:
        """Received tensors on this stage's device; activations become leaves needing grad."""
        if isinstance(tensors, torch.Tensor):
            tensors = unpack(tensors)
        device = self._runners[0].device
        out = [t.to(device) for t in tensors]
        return [t.requires_grad_() for t in out] if grad else out

    @property
    def _receives(self) -> list[tuple[int, str]]:
        """(source rank, tag) of every tensor this stage receives, in schedule order."""
        p, last = self.num_stages, self.num_stages * self.virtual_stages - 1
        prev, nxt = ring_neighbours(self.stage_index, p)
        out = []
        for kind, _, c in self.steps:
            k = c * p + self.stage_index
            if kind == "F" and k != 0:
                out.append((prev, "act"))
            elif kind == "B" and k != last:
                out.append((nxt, "grad"))
        return out

    def _pools(self) -> Any:
        """The send and receive threads, kept for the model's life."""
        if self._comm_pools is None:
            self._comm_pools = new_pools()
        return self._comm_pools

    def abandon(self) -> None:
        """After a failed step: a transfer still waiting (a receive from a rank that failed)
        is left to end on its own thread, and the next step gets fresh threads."""
        pools, self._comm_pools = self._comm_pools, None
        for pool in pools or ():
            pool.shutdown(wait=False, cancel_futures=True)

    def _sync_tied_grads(self, stashed: list[list[torch.Tensor | None]]) -> None:
        """Megatron's embedding all-reduce: every copy gets the sum of all copies' gradients."""
        for (group, params), old in zip(self.tied_groups, stashed, strict=True):
            local = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
            flat = torch.cat([g.detach().reshape(-1) for g in local])
            total = group.all_reduce(flat)
            offset = 0
            for q, before in zip(params, old, strict=True):
                g = total[offset : offset + q.numel()].view_as(q).clone()
                offset += q.numel()
                q.grad = g if before is None else before + g

    # -- state -------------------------------------------------------------------------------
    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state dict under the whole model's names."""
        return self.stage.state_dict()

    def _pp_group(self) -> Any:
        return None if self.num_stages == 1 else self.pp

    def gather_full_state_dict(
        self, stage_state: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The whole model's state dict on every rank (collective over the pipeline group).
        A tied weight comes from its first holder. ``stage_state``: what this rank gives,
        when not its stage's own state dict (a 3D rank's, gathered over its tensor group)."""
        mine = self.stage.state_dict() if stage_state is None else stage_state
        got = gather(self._pp_group(), self._state_layouts, mine)
        return {k: got[k] for k in self.full_keys if k in got}

    def gather_full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient under ``model.named_parameters()`` names, on every rank
        (collective); a missing gradient counts as zeros."""
        grads = {n: _grad_of(q) for n, q in self.stage.named_parameters()}
        got = gather(self._pp_group(), self._grad_layouts, grads)
        return {n: got[n] for n in self._full_param_names}


def _grad_of(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _detach(out: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
