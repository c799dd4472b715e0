"""benchmarks/collectives.py's training part: a training step across the lab's hosts, ours against
torch's on gloo in the same namespaces, at each link rate.

One namespace ("host") per rank. Ours: each host runs a shard server (``_server --bind`` its
address) and its rank (``benchmarks.strategies _ours`` with every server's address); the rank
reaches its own server through shared memory (same namespace, as a trainer beside its server on
one machine) and the others in-band over the shaped links. Torch: the same rank processes
(``benchmarks.strategies _torch``), rank 0's store on host 0, ``GLOO_SOCKET_IFNAME=eth0``.
DDP against ``DistributedDataParallel`` and FSDP against FSDP2, on the GPT of
``benchmarks.strategies`` (``--train-model``: small, 13.8M parameters, 4 sequences of 128 tokens
per rank; tiny with ``--quick``), AdamW; step time = the slowest rank's, median after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from typing import Any

from benchmarks._collective_ranks import MiB
from benchmarks._processes import Child, child_env, expect_all, free_port, stop_all
from benchmarks._training import GLOO_ADDR_ENV, MODELS, median_ms
from benchmarks._transport import child, log

PEERS = {"ddp": "ddp", "fsdp": "fsdp2"}  # ours -> the torch mode of benchmarks.strategies


def _ranks(
    lab: Any, w: int, mode: str, argv: list[str], env: dict[str, str], budget: float
) -> list[Child]:
    return [
        Child.module(
            f"ns{mode}r{r}",
            "benchmarks.strategies",
            [mode, *argv, "--rank", str(r)],
            env,
            budget,
            lab.exec_prefix(lab.hosts[r]),
        )
        for r in range(w)
    ]


def _run(lab: Any, w: int, side: str, strategy: str, a: argparse.Namespace) -> list[dict]:
    model = a.train_model
    steps = MODELS[model]["steps"]
    budget = 180.0 + steps * MODELS[model]["step_budget_s"]
    argv = ["--model", model, "--world", str(w), "--steps", str(steps)]
    kids: list[Child] = []
    try:
        if side == "torch":
            env = child_env(False)
            env.update({GLOO_ADDR_ENV: lab.ip[lab.hosts[0]], "GLOO_SOCKET_IFNAME": "eth0"})
            argv += ["--strategy", PEERS[strategy], "--port", str(free_port())]
            kids = _ranks(lab, w, "_torch", argv, env, budget)
            return [json.loads(x) for x in expect_all(kids, "RESULT", budget, watch=kids)]
        servers = [
            child(f"nstrain-server{i}", ["_server", "--bind", lab.ip[h]], child_env(True),
                  budget + 60, lab.exec_prefix(h))
            for i, h in enumerate(lab.hosts[:w])
        ]  # fmt: skip
        kids += servers
        addresses = expect_all(servers, "ADDR", 60, watch=servers)
        argv += ["--strategy", strategy, "--run", f"n{uuid.uuid4().hex[:10]}"]
        argv += ["--servers", ",".join(addresses)]
        ranks = _ranks(lab, w, "_ours", argv, child_env(True), budget)
        kids += ranks
        results = [json.loads(x) for x in expect_all(ranks, "RESULT", budget, watch=kids)]
        for k in ranks:
            k.send("EXIT")
        return results
    finally:
        stop_all(kids)


def section_training(a: argparse.Namespace, lab: Any, rate: float | None) -> list[dict]:
    """Rows of ours / torch step times at every world size, links at ``rate`` Gbit/s."""
    rows = []
    warm = MODELS[a.train_model]["warmup"]
    for w in a.world_sizes:
        for strategy in PEERS:
            row: dict[str, Any] = {"rate_gbit": rate, "world_size": w, "strategy": strategy}
            row["model"] = a.train_model
            row["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
            try:
                for side in ("torch", "ours"):
                    log(f"training W={w} {strategy} {side}, links {rate or 'unlimited'}")
                    res = _run(lab, w, side, strategy, a)
                    row[f"{side}_ms"] = median_ms(res, warm)[0]
                    row[f"{side}_step_ms"] = median_ms(res, warm)[1]
                row["ratio"] = round(row["ours_ms"] / row["torch_ms"], 3)
                log(f"  ours {row['ours_ms']} ms, torch {row['torch_ms']} ms: {row['ratio']}")
            except Exception as exc:  # noqa: BLE001 - one failed cell must not end the run
                row["error"] = f"{type(exc).__name__}: {exc}"
                log(f"  FAILED: {row['error']}")
            rows.append(row)
    return rows


def gradient_mib(model: str) -> float:
    """The float32 gradient a DDP step all-reduces, MiB (for the report)."""
    from benchmarks._training import build_gpt

    return round(4 * build_gpt(model).num_params() / MiB, 1)
