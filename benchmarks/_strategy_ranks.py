"""The ranks of benchmarks/strategies.py: ours (a strategy over shard servers) and torch's twin
(gloo DDP, ZeroRedundancyOptimizer, FSDP2), each timing its steps and measuring its memory."""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks._cpu import cpu_self_s, peak_rss_bytes
from benchmarks._processes import child_guard, emit
from benchmarks._training import (
    ADAMW,
    MODELS,
    adamw,
    build_gpt,
    close_rank,
    end_gloo,
    hosted_server,
    init_gloo,
    make_batches,
    set_threads,
    wait_exit,
)


def tensor_bytes(t: Any) -> int:
    import torch

    if not isinstance(t, torch.Tensor):
        return 0
    if hasattr(t, "to_local"):  # DTensor: this rank's part
        t = t.to_local()
    return t.numel() * t.element_size()


def optimizer_state_bytes(opt: Any) -> int:
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's in .optim
    return sum(tensor_bytes(v) for st in inner.state.values() for v in st.values())


class GradTracker:
    """Peak bytes of ``.grad`` held at once over ``params``, sampled whenever a gradient has
    been accumulated. Registered before a strategy's own hooks, it runs first and so sees each
    gradient before the strategy pushes and frees it."""

    def __init__(self, params: list) -> None:
        self.params = params
        self.enabled = False
        self.peak = 0
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)

    def live(self) -> int:
        return sum(tensor_bytes(p.grad) for p in self.params if p.grad is not None)

    def _hook(self, _p: Any) -> None:
        if self.enabled:
            self.peak = max(self.peak, self.live())


def timed_steps(
    model: Any, opt: Any, loss_fn: Any, batches: list, rank: int, per: int
) -> tuple[list[float], list[float], list[list[float]]]:
    """Runs one training step per batch on this rank's rows; returns each step's seconds, each
    step's loss and each step's (forward, backward, optimizer step) seconds."""
    import torch

    times, losses, phases = [], [], []
    for x, y in batches:
        xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xs), ys)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        times.append(t3 - t0)
        phases.append([t1 - t0, t2 - t1, t3 - t2])
        losses.append(loss.detach())
    return times, [float(torch.as_tensor(v).item()) for v in losses], phases


def phase_seconds(t_start: float, t_setup: float, t_train: float) -> dict[str, float]:
    """A rank's wall time by phase (monotonic stamps): setup, train, accounting until now."""
    return {
        "setup": round(t_setup - t_start, 2),
        "train": round(t_train - t_setup, 2),
        "accounting": round(time.monotonic() - t_train, 2),
    }


def ours_main(a: argparse.Namespace) -> None:
    t_start = time.monotonic()
    child_guard(a.lifetime)

    from paramshard.client import ClusterSpec, ShardClient
    from paramshard.models.gpt import Block, lm_loss
    from paramshard.strategies import (
        DATA_PARALLEL,
        ShardingConfiguration,
    )

    set_threads(a.world)
    server, clients = None, []
    try:
        if a.servers:
            addresses = a.servers.split(",")
        else:  # in-process: host one server, learn the others' addresses from the parent
            server, addresses = hosted_server()
        client = ShardClient(
            ClusterSpec(addresses), rank=a.rank, world_size=a.world, run_id=a.run, timeout_s=120.0
        )
        clients.append(client)
        config = ShardingConfiguration(client, job=f"bench-{a.strategy}-{a.run}", timeout_s=120.0)
        gpt = build_gpt(a.model)
        n_params = gpt.num_params()
        model_cls, opt_cls = DATA_PARALLEL[a.strategy]
        model = (
            model_cls(gpt, config, wrap=(Block,))
            if a.strategy == "fsdp"
            else model_cls(gpt, config)
        )
        params = [p for p in gpt.parameters() if p.requires_grad]
        tracker = GradTracker(params)  # before the optimizer: ZeRO-2 / FSDP hook in at attach
        inner = adamw(params)
        opt = opt_cls(inner, config)

        per = MODELS[a.model]["batch_per_rank"]
        batches = make_batches(a.model, a.world, a.steps + 1)
        t_setup, cpu0 = time.monotonic(), cpu_self_s()
        times, losses, phases = timed_steps(model, opt, lm_loss, batches[:-1], a.rank, per)
        t_train, cpu_timed = time.monotonic(), cpu_self_s() - cpu0

        # -- the untimed accounting step
        x, y = batches[-1]
        xs, ys = x[a.rank * per : (a.rank + 1) * per], y[a.rank * per : (a.rank + 1) * per]
        opt.zero_grad(set_to_none=True)
        tracker.enabled, tracker.peak = True, 0
        lm_loss(model(xs), ys).backward()
        grads_after_backward = tracker.live()
        opt.step()
        tracker.enabled = False
        grad_peak = max(tracker.peak, grads_after_backward)
        if a.strategy == "fsdp":
            param_bytes = int(model.peak_live_bytes)
        else:
            param_bytes = sum(tensor_bytes(p.data) for p in params)
        trainer = {
            "param_bytes": param_bytes,
            "grad_bytes": grad_peak,
            "optimizer_bytes": optimizer_state_bytes(inner),
        }
        extra: dict[str, Any] = {}
        if a.strategy == "zero2":
            extra["largest_bucket_bytes"] = max(4 * b.numel for b in model._buckets)
        if a.strategy == "fsdp":
            sizes = sorted((u.nbytes for u in model._unit_list[1:]), reverse=True)
            extra["root_unit_bytes"] = model._unit_list[0].nbytes
            extra["largest_units_bytes"] = sizes[:2]
        row = client.status()[a.rank]
        srv = {"param_bytes": 0, "grad_bytes": 0, "optimizer_bytes": 0}
        step_s = 0.0
        for job in row.get("jobs", []):
            if job.get("job") == config.job:
                for b in job.get("buffers", []):
                    for k in srv:
                        srv[k] += int(b.get(k, 0))
                    step_s += float(b.get("last_step_seconds", 0.0))
        srv["slot_bytes"] = int(row.get("slot_bytes", 0))
        extra["server_last_step_ms"] = round(step_s * 1e3, 2)
        emit(
            "RESULT",
            {
                "rank": a.rank,
                "n_params": n_params,
                "times_s": times,
                "phases": phases,
                "losses": losses,
                "trainer": trainer,
                "server": srv,
                "extra": extra,
                "peak_rss_bytes": peak_rss_bytes(),
                "cpu_s": cpu_timed,
                "phases_s": phase_seconds(t_start, t_setup, t_train),
            },
        )
        wait_exit()
    finally:
        close_rank(clients, server)  # a failed rank's too: see close_rank


def torch_main(a: argparse.Namespace) -> None:
    t_start = time.monotonic()
    child_guard(a.lifetime)
    import torch

    from paramshard.models.gpt import Block, lm_loss

    W = a.world
    single = a.strategy == "single"
    set_threads(1 if single else W)
    if not single:
        init_gloo(a.port, a.rank, W)
    gpt = build_gpt(a.model)
    n_params = gpt.num_params()

    if single:
        model, opt = gpt, adamw(gpt.parameters())
    elif a.strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(gpt, forward_sync_buffers=False)  # the mask buffer is a constant
        if a.strategy == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                model.parameters(),
                optimizer_class=torch.optim.AdamW,
                **ADAMW,
            )
        else:
            opt = adamw(model.parameters())
    elif a.strategy in ("fsdp2", "fsdp2_zero2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (W,))
        raf = a.strategy == "fsdp2"
        for m in gpt.modules():
            if isinstance(m, Block):
                fully_shard(m, mesh=mesh, reshard_after_forward=raf)
        fully_shard(gpt, mesh=mesh, reshard_after_forward=raf)
        model, opt = gpt, adamw(gpt.parameters())
    else:
        raise ValueError(a.strategy)

    per = MODELS[a.model]["batch_per_rank"] * (W if single else 1)
    rank = 0 if single else a.rank
    batches = make_batches(a.model, W, a.steps + 1)
    t_setup, cpu0 = time.monotonic(), cpu_self_s()
    times, losses, phases = timed_steps(model, opt, lm_loss, batches[:-1], rank, per)
    t_train, cpu_timed = time.monotonic(), cpu_self_s() - cpu0
    # accounting step: gradients are held until the next zero_grad
    timed_steps(model, opt, lm_loss, batches[-1:], rank, per)
    ps = list(model.parameters())
    mem = {
        "param_bytes": sum(tensor_bytes(p) for p in ps),
        "grad_bytes": sum(tensor_bytes(p.grad) for p in ps if p.grad is not None),
        "optimizer_bytes": optimizer_state_bytes(opt),
    }
    emit(
        "RESULT",
        {
            "rank": a.rank,
            "n_params": n_params,
            "times_s": times,
            "phases": phases,
            "losses": losses,
            "trainer": mem,
            "peak_rss_bytes": peak_rss_bytes(),
            "cpu_s": cpu_timed,
            "phases_s": phase_seconds(t_start, t_setup, t_train),
        },
    )
    if not single:
        end_gloo()
