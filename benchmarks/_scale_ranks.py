"""The rank processes of ``benchmarks.scale``: ours (DDP, ZeRO-2, FSDP over separate ``paramshard
serve`` processes) and torch's twins on gloo (DDP, DDP + ZeroRedundancyOptimizer, FSDP2), the
process that measures a bare trainer's memory, and the one that measures a rank's compute alone
(``compute_main``: one process, no peers, no servers).

Each rank trains the same model from the same seed on its rows of the same global batches with
AdamW, one intra-op thread, and answers ``RESULT {json}``, per step:

- the wall seconds, and forward / backward / optimizer-step seconds;
- (ours) the seconds its training thread waited on the servers and its background threads
  spent in calls, by kind (``model.comm_times``); rank 0 also the servers' optimizer-step
  seconds (their Status) and the CPU seconds the server processes used (``--server-pids``:
  read from /proc, they run on this host);
- the CPU seconds of the rank's process (all its threads), by kind of thread
  (``threads_cpu``: the training thread's ``main``, the strategy's, grpc's and gloo's
  threads), and the training thread's in forward, backward and optimizer step
  (``main_cpu``);
- the process's minor page faults (``minor_faults``);
- the seconds Python's garbage collector took, by generation (``GcClock``);

and the losses and its peak resident memory.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks._cpu import peak_rss_bytes, proc_cpu_s, process_threads_cpu_s, threads_cpu_s
from benchmarks._processes import child_guard, emit, wait_parent_eof
from benchmarks._scale_models import ADAMW, MODELS, batches, build, loss_of

STEP_TIMEOUT_S = 900.0  # a 1B-parameter step on 2 cores takes about a minute


def rss_bytes(pid: int | str = "self") -> tuple[int, int]:
    """(resident now, peak resident) bytes of process ``pid``, from /proc."""
    kinds = rss_kinds(pid)
    return kinds["VmRSS"], kinds["VmHWM"]


def rss_kinds(pid: int | str = "self") -> dict[str, int]:
    """Process ``pid``'s resident bytes now (VmRSS; of them RssAnon: its own memory, RssShmem:
    shared segments it maps) and at the peak (VmHWM), from /proc."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                out[key] = int(line.split()[1]) * 1024
    return out


def gathered_units_bytes(net: Any, psi: int) -> int:
    """4 bytes x (the root unit + the two largest blocks): what FSDP holds gathered at most
    (the block computing and the one prefetched; the root stays gathered through the step).
    Units are the model's ``_no_split_modules`` blocks, the root is the rest."""
    names = set(net._no_split_modules)
    blocks = sorted(
        (sum(p.numel() for p in m.parameters()) for m in net.modules()
         if type(m).__name__ in names),
        reverse=True,
    )  # fmt: skip
    return 4 * (psi - sum(blocks) + sum(blocks[:2]))


def one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # one intra-op thread per rank, both sides (the rule)
    import transformers

    transformers.logging.set_verbosity_error()  # one line per rank about loss_type=None


def overhead_main(a: argparse.Namespace) -> None:
    """A trainer's memory before any model: interpreter, torch, transformers, paramshard."""
    child_guard(a.lifetime)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from paramshard.client import ShardClient  # noqa: F401
    from paramshard.strategies import DATA_PARALLEL  # noqa: F401

    one_thread()
    emit("RESULT", {"rss_bytes": rss_bytes()[0]})


def compute_main(a: argparse.Namespace) -> None:
    """One rank's work with nobody to talk to: the model, plain AdamW over all of it, rank 0's
    rows of a W = 1 batch (the per-rank batch of every cell). What a step costs before any
    communication: benchmarks/_cost_steps.py predicts the cells' steps from it."""
    child_guard(a.lifetime)
    one_thread()
    import torch

    net = build(a.model)
    result = _train(a, net, torch.optim.AdamW(net.parameters(), **ADAMW))
    emit("RESULT", {"rank": 0, **result, "peak_rss_bytes": peak_rss_bytes()})


def _server_step_seconds(client: Any, job: str) -> float:
    """The slowest server's optimizer-step seconds of its last step of ``job`` (buffers are
    stepped one after another, so a server's is their sum)."""
    worst = 0.0
    for row in client.status():
        for j in row.get("jobs", []):
            if j.get("job") == job:
                worst = max(worst, sum(float(b.get("last_step_seconds", 0)) for b in j["buffers"]))
    return worst


class GcClock:
    """Seconds the process spent in Python's cyclic garbage collector, by generation, between
    ``take()`` calls (``gc.callbacks``: a collection runs in the thread that triggered it,
    holding the GIL, so on a rank it is time out of the step)."""

    def __init__(self) -> None:
        import gc

        self._start = 0.0
        self._spent = {0: 0.0, 1: 0.0, 2: 0.0}
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self._spent[info["generation"]] += time.perf_counter() - self._start

    def take(self) -> dict[str, float]:
        out = {f"gen{g}": round(s, 4) for g, s in self._spent.items()}
        self._spent = dict.fromkeys(self._spent, 0.0)
        return out


def minor_faults() -> int:
    """Minor page faults of this process so far, all its threads (a fresh page of memory
    touched for the first time: freed and allocated again, a large tensor faults again)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _train(a: argparse.Namespace, model: Any, opt: Any, after_step: Any = None) -> dict[str, Any]:
    """The timed steps on this rank's rows; per-step figures (see the module docstring)."""
    per = MODELS[a.model].batch_per_rank
    rows = slice(a.rank * per, (a.rank + 1) * per)
    steps: list[dict[str, Any]] = []
    losses = []
    gc_clock = GcClock()
    for x in batches(a.model, a.world, a.steps):
        xs = x[rows]
        c0, threads0, faults0 = time.process_time(), threads_cpu_s(), minor_faults()
        t0, m0 = time.perf_counter(), time.thread_time()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, xs)
        t1, m1 = time.perf_counter(), time.thread_time()
        loss.backward()
        t2, m2 = time.perf_counter(), time.thread_time()
        opt.step()
        t3, m3 = time.perf_counter(), time.thread_time()
        losses.append(float(loss.detach()))
        row: dict[str, Any] = {"s": t3 - t0, "forward": t1 - t0, "backward": t2 - t1}
        row["optimizer"] = t3 - t2
        row["main_cpu"] = {"forward": m1 - m0, "backward": m2 - m1, "optimizer": m3 - m2}
        row["cpu"] = time.process_time() - c0
        row["minor_faults"] = minor_faults() - faults0
        threads = threads_cpu_s()
        # a kind whose thread ended within the step took its seconds along: none, not less
        row["threads_cpu"] = {
            k: round(max(0.0, v - threads0.get(k, 0.0)), 2) for k, v in threads.items()
        }
        row["gc_s"] = gc_clock.take()
        row["peak_rss_mb"] = round(rss_bytes()[1] / 2**20)  # when the peak happens
        if after_step is not None:
            row.update(after_step())
        steps.append(row)
    return {"steps": steps, "losses": losses}


def ours_main(a: argparse.Namespace) -> None:
    child_guard(a.lifetime)
    one_thread()
    from paramshard.client import ClusterSpec, ShardClient
    from paramshard.strategies import DATA_PARALLEL, ShardingConfiguration

    knobs = {"chunk_bytes": int(a.chunk_mib * 2**20)} if a.chunk_mib else {}
    if a.in_flight:
        knobs["max_in_flight"] = a.in_flight
    client = ShardClient(
        ClusterSpec(a.servers.split(",")),
        rank=a.rank,
        world_size=a.world,
        run_id=a.run,
        timeout_s=STEP_TIMEOUT_S,
        **knobs,
    )
    job = f"scale-{a.strategy}-{a.run}"
    config = ShardingConfiguration(
        client,
        job=job,
        timeout_s=STEP_TIMEOUT_S,
        deterministic=not a.arrival_order,
        gradient_as_bucket_view=a.bucket_views,
    )
    net = build(a.model)
    built = rss_bytes()[1]
    psi = sum(p.numel() for p in set(net.parameters()))
    model_cls, opt_cls = DATA_PARALLEL[a.strategy]
    model = model_cls(net, config)
    import torch

    opt = opt_cls(torch.optim.AdamW(net.parameters(), **ADAMW), config)  # registers
    setup_rss = rss_bytes()[0]
    extra_setup = {"peak_after_build_mb": round(built / 2**20)}
    extra_setup["peak_after_setup_mb"] = round(rss_bytes()[1] / 2**20)
    extra: dict[str, Any] = {}
    if a.strategy == "fsdp":
        extra["gathered_units_bytes"] = gathered_units_bytes(net, psi)

    server_pids = [int(pid) for pid in a.server_pids.split(",") if pid]
    servers_cpu = [sum(proc_cpu_s(pid) for pid in server_pids)]  # at the last step's end
    servers_threads = [_servers_threads(server_pids)]

    def after_step() -> dict[str, Any]:
        out: dict[str, Any] = {"comm": model.comm_times.take()}
        if a.rank == 0 and a.strategy != "ddp":
            out["server_step_s"] = _server_step_seconds(client, job)
        if a.rank == 0 and server_pids:
            now = sum(proc_cpu_s(pid) for pid in server_pids)
            out["servers_cpu"], servers_cpu[0] = now - servers_cpu[0], now
            kinds, before = _servers_threads(server_pids), servers_threads[0]
            out["servers_threads_cpu"] = {
                k: round(max(0.0, v - before.get(k, 0.0)), 3) for k, v in kinds.items()
            }
            servers_threads[0] = kinds
        return out

    result = _train(a, model, opt, after_step)
    if a.strategy == "fsdp":
        extra["peak_live_bytes"] = int(model.peak_live_bytes)
    emit(
        "RESULT",
        {
            "rank": a.rank,
            "n_params": psi,
            **result,
            "setup_rss_bytes": setup_rss,
            "peak_rss_bytes": peak_rss_bytes(),
            "rss_at_end": rss_kinds(),
            **extra_setup,
            **extra,
        },
    )
    wait_parent_eof()  # others may still pull from the servers: leave together
    client.close()


def _servers_threads(pids: list[int]) -> dict[str, float]:
    """The servers' CPU seconds so far by kind of thread, all servers together."""
    out: dict[str, float] = {}
    for pid in pids:
        for kind, cpu in process_threads_cpu_s(pid).items():
            out[kind] = out.get(kind, 0.0) + cpu
    return out


def _torch_wrap(a: argparse.Namespace, net: Any) -> tuple[Any, Any]:
    import torch

    if a.strategy in ("ddp", "zero1", "zero2"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net, gradient_as_bucket_view=a.bucket_views)
        if a.strategy == "ddp":
            return model, torch.optim.AdamW(model.parameters(), **ADAMW)
        # ZeRO-1 and ZeRO-2 alike: torch's one optimizer-state sharding over DDP
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW
        )
        return model, opt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (a.world,))
    blocks = set(net._no_split_modules)
    for m in net.modules():
        if type(m).__name__ in blocks:
            fully_shard(m, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW(net.parameters(), **ADAMW)


def torch_main(a: argparse.Namespace) -> None:
    child_guard(a.lifetime)
    one_thread()
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{a.port}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S),
    )
    net = build(a.model)
    built = rss_bytes()[1]
    psi = sum(p.numel() for p in set(net.parameters()))
    model, opt = _torch_wrap(a, net)
    setup_rss = rss_bytes()[0]
    extra_setup = {"peak_after_build_mb": round(built / 2**20)}
    extra_setup["peak_after_setup_mb"] = round(rss_bytes()[1] / 2**20)
    result = _train(a, model, opt)
    emit(
        "RESULT",
        {
            "rank": a.rank,
            "n_params": psi,
            **result,
            "setup_rss_bytes": setup_rss,
            "peak_rss_bytes": peak_rss_bytes(),
            **extra_setup,
        },
    )
    dist.barrier()
    dist.destroy_process_group()
