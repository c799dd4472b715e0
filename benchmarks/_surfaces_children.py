"""The child processes of ``benchmarks.surfaces``: a training rank, one ``paramshard`` command
run in a process of its own, and the torch reference.

- ``rank_main``: one FSDP rank of the HF GPT-2 of ``_scale_models`` (dropout off, one intra-op
  thread, AdamW) against separate ``paramshard serve`` processes, trained through
  ``train_with_recovery`` (``checkpoint_every=0``) with or without ``replicate_every``, so the
  two conditions differ only in the replicas. Answers ``RESULT`` with every step's seconds
  (forward, backward and optimizer step), its losses, its peak resident memory and (rank 0)
  what ``ListReplicas`` reports at the end.
- ``cli_main``: ``paramshard ARGS`` (snapshot, export, restore) through ``paramshard.cli.main``
  in this process, timed from the call to its return (no interpreter start), with the
  process's resident memory before and its peak during the command (the peak is reset first:
  ``/proc/self/clear_refs``).
- ``reference_main``: what torch does with the same state from one process, each in a
  process of its own: ``torch.save`` of the model's state dict and an AdamW state of the same
  shapes (after one step) to the benchmark's folder, fsynced as a snapshot's shards are;
  ``torch.load`` of that file; ``safetensors.torch.save_file`` of the state dict (tied
  weights under both names, as the export writes them), fsynced. Each one's seconds and its
  rise of peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from benchmarks._processes import child_guard, emit, wait_parent_eof
from benchmarks._scale_models import ADAMW, MODELS, batches, build, loss_of
from benchmarks._scale_ranks import one_thread, rss_kinds

STEP_TIMEOUT_S = 600.0  # a rank's wait on the servers (a GPT-2 124M step takes 2-4 s here)


def reset_peak(pid: int | str = "self") -> None:
    """Resets process ``pid``'s peak resident memory (VmHWM) to its resident memory now
    (Linux: ``5`` to ``/proc/PID/clear_refs``), so a later VmHWM is the peak since."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _peak_since_reset() -> dict[str, int]:
    kinds = rss_kinds()
    return {"peak_bytes": kinds["VmHWM"], "rss_after_bytes": kinds["VmRSS"]}


# ================================================================================ rank
def rank_main(a: argparse.Namespace) -> None:
    child_guard(a.lifetime)
    one_thread()
    import torch

    from paramshard import FSDPModel, FSDPOptimizer, ShardingConfiguration, train_with_recovery
    from paramshard.client import ClusterSpec, ShardClient

    client = ShardClient(
        ClusterSpec(a.servers.split(",")),
        rank=a.rank,
        world_size=a.world,
        run_id=a.run,
        timeout_s=STEP_TIMEOUT_S,
    )
    try:
        config = ShardingConfiguration(
            client, job=a.job, timeout_s=STEP_TIMEOUT_S, replicate_every=a.replicate_every
        )
        net = build(a.model)
        model = FSDPModel(net, config)
        opt = FSDPOptimizer(torch.optim.AdamW(net.parameters(), **ADAMW), config)
        per = MODELS[a.model].batch_per_rank
        mine = [x[a.rank * per : (a.rank + 1) * per] for x in batches(a.model, a.world, a.steps)]
        steps: list[dict[str, float]] = []

        def step(n: int) -> float:
            t0 = time.perf_counter()
            loss = loss_of(model, mine[n])
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            steps.append({"n": n, "s": t3 - t0, "forward": t1 - t0, "backward": t2 - t1})
            steps[-1]["optimizer"] = t3 - t2
            return float(loss.detach())

        report = train_with_recovery(model, step, steps=a.steps, checkpoint_every=0)
        result: dict[str, Any] = {
            "rank": a.rank,
            "steps": steps,
            "losses": [report.losses[n] for n in sorted(report.losses)],
            "recoveries": report.recoveries,
            "peak_rss_bytes": rss_kinds()["VmHWM"],
        }
        if a.rank == 0:
            result["replicas"] = _replicas(client, a.job)
        emit("RESULT", result)
        wait_parent_eof()  # the other rank may still pull from the servers: leave together
    finally:
        client.close()


def _replicas(client: Any, job: str) -> list[dict[str, Any]]:
    """Per server, the replicas of ``job`` it holds (versions, own or its neighbour's, bytes)
    and why its newest one was not made, if it was not (``ListReplicas``)."""
    from paramshard.client.rpc import Call
    from paramshard.protos import shard_pb2 as pb

    replies = client.run(
        Call(i, "ListReplicas", pb.ListReplicasRequest(job=job)) for i in range(client.num_servers)
    )
    return [
        {
            "server": i,
            "held": [
                {"source": r.source_index, "version": r.version, "bytes": r.bytes, "own": r.own}
                for r in reply.replicas
            ],
            "failure": reply.failure,
        }
        for i, reply in enumerate(replies)
    ]


# ================================================================================ one command
def cli_main(a: argparse.Namespace) -> None:
    """``paramshard *a.command`` in this process: its exit code, seconds and memory."""
    child_guard(a.lifetime)
    # what the commands import, imported before the memory is read: the rise is the command's
    import grpc  # noqa: F401
    import numpy  # noqa: F401

    import paramshard.client.export  # noqa: F401
    import paramshard.offline_export  # noqa: F401
    from paramshard import cli
    from paramshard.client import tools  # noqa: F401

    before = rss_kinds()["VmRSS"]
    reset_peak()
    t0 = time.perf_counter()
    code = cli.main(a.command)
    wall = time.perf_counter() - t0
    emit("RESULT", {"rc": code, "wall_s": wall, "rss_before_bytes": before, **_peak_since_reset()})


# ================================================================================ reference
def reference_main(a: argparse.Namespace) -> None:
    """One of torch.save, torch.load and safetensors' save_file of the same state (``a.op``),
    in a process of its own: memory a process freed before (a gradient, a loaded checkpoint)
    would serve the next operation's allocations, and hide its rise."""
    child_guard(a.lifetime)
    one_thread()
    import torch

    pt, st = os.path.join(a.dir, "reference.pt"), os.path.join(a.dir, "reference.safetensors")
    if a.op == "torch_load":  # the file torch_save wrote: nothing else in this process
        got = _timed(lambda: torch.load(pt, weights_only=True))
        os.remove(pt)
        emit("RESULT", got)
        return
    net = build(a.model)
    if a.op == "save_file":
        from safetensors.torch import save_file

        tensors, seen = {}, set()
        for name, t in net.state_dict().items():  # a tied weight under each name: its own copy
            tensors[name] = t.clone() if t.data_ptr() in seen else t.contiguous()
            seen.add(t.data_ptr())
        got = _timed(lambda: _save_synced(None, st, lambda: save_file(tensors, st)))
        got["file_bytes"] = os.path.getsize(st)
        os.remove(st)
        emit("RESULT", got)
        return
    opt = torch.optim.AdamW(net.parameters(), **ADAMW)
    for p in net.parameters():  # one step, so that AdamW holds both moments of every parameter
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    got = _timed(lambda: _save_synced(lambda f: torch.save(_state(net, opt), f), pt))
    got["file_bytes"] = os.path.getsize(pt)
    got["n_params"] = sum(p.numel() for p in set(net.parameters()))
    emit("RESULT", got)  # the file stays for torch_load


def _state(net: Any, opt: Any) -> dict[str, Any]:
    """What a torch checkpoint of the job holds: the model's and the optimizer's state dicts
    (views of their tensors: no copy)."""
    return {"model": net.state_dict(), "optimizer": opt.state_dict()}


def _timed(fn: Any) -> dict[str, Any]:
    """Seconds of ``fn()`` and this process's resident memory before it and at its peak."""
    import gc

    gc.collect()
    before = rss_kinds()["VmRSS"]
    reset_peak()
    t0 = time.perf_counter()
    got = fn()
    wall = time.perf_counter() - t0
    peak = _peak_since_reset()
    del got
    return {"wall_s": wall, "rss_before_bytes": before, **peak}


def _save_synced(write: Any, path: str, save: Any = None) -> None:
    """Writes ``path`` (``write(file)``, or ``save()`` that opens it itself), then fsyncs it:
    a snapshot's shards and an export are fsynced too."""
    if save is None:
        with open(path, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        return
    save()
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


# ================================================================================ arguments
def child_parser() -> argparse.ArgumentParser:
    """The hidden modes' arguments (``python -m benchmarks.surfaces _rank|_cli|_reference``)."""
    p = argparse.ArgumentParser()
    for k in ("--model", "--servers", "--run", "--job", "--dir", "--op"):
        p.add_argument(k, default="")
    for k in ("--world", "--rank", "--steps", "--replicate-every"):
        p.add_argument(k, type=int, default=0)
    p.add_argument("--lifetime", type=float, default=3600.0)
    p.add_argument("--command", type=json.loads, default=[], help="_cli: paramshard's arguments")
    return p


CHILDREN = {"_rank": rank_main, "_cli": cli_main, "_reference": reference_main}
