"""Step time of our pipeline, tensor and 3D parallelism against PyTorch's own, on the same
model: the example GPT and Hugging Face's Llama.

    python -m benchmarks.hybrid [--quick] [--models tiny,small,gpt2] [--world-sizes 4,2] [--steps N]
                                [--warmup K] [--micro-batches M] [--wait-quiet S]
                                [--family gpt|llama|both]

For every model size and world size W, in one run (torch and ours interleaved, cell by cell,
so both sides see the same machine load):

- **ours**: ``HybridShardedModel`` with W trainer processes, each hosting its own in-process
  ``ShardServer`` (as ``benchmarks.strategies`` does by default), started with ``subprocess``
  and ``server.MALLOC_ENV``. Cells (pipeline x tensor x data):
  ``pp_gpipe`` = (W, 1, 1) GPipe, ``pp_1f1b`` = (W, 1, 1) 1F1B, ``tp`` = (1, W, 1) and
  ``3d`` = (2, 2, W/4) GPipe (only where 4 divides W). A step is
  ``model.train_on_batch(x, y)``: forward and backward through the schedule, then the
  optimizer step (ZeRO-1 on the servers of each (stage, tensor rank)).
- **torch** (gloo, same GPT, same batches, same AdamW; ``benchmarks/_torch_parallel.py``):
  ``torch.distributed.pipelining`` ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``
  over the same stages (``benchmarks/_gpt_stages.py``); DTensor ``parallelize_module`` with
  Megatron's split of attention (by heads: our packed q|k|v ``c_attn`` is first rewritten as
  three Linears with the same weights, since a plain ``ColwiseParallel`` on it would not split
  by heads) and of the MLP; 3D = device mesh (pp, tp, dp) + pipelining GPipe + DTensor TP +
  an all-reduce of the gradients over dp. Plus single-process training on the whole global
  batch (the numerical reference).

Model: ``paramshard.models.gpt`` with the benchmarks' sizes (see ``benchmarks/_training.py``):
tiny = ``GPTConfig.tiny(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128,
tie_weights=False)``, 867,072 parameters; ``--models gpt2``: GPT-2 124M's shape (768 wide, 12
layers, 12 heads, vocabulary 50,257, 128-token sequences, 2 a rank), untied because torch's
pipelining splits no tied weight: 162,349,056 parameters. The global batch is W x 8 sequences
(``W*B``; gpt2: W x 2): the pipeline cells run all of it through the pipeline in m
micro-batches, the tensor cell gives all of it to every rank, the 3D cell splits it over the
dp replicas. m defaults to 2 x the number of stages for the pipeline cells
(``--micro-batches`` sets it), 1 for ``tp``; both sides use the same m.

Llama (``--family``, default both; ``benchmarks/_llama_stages.py``): ``LlamaForCausalLM`` from
a config (tiny: hidden 256, 4 layers, 4 heads, 2 key/value heads, 3,033,344 parameters, SDPA)
on the same batches. Ours is given ``split_points=["model.layers.2"]`` and no plan (Llama's
own), ``train_on_batch({"input_ids": x}, y)``; torch's side pipelines stage modules with the
same cut and applies Llama's plan as DTensor styles. Its cells always have 2 stages and 2
tensor ranks, the other ranks data-parallel: pp = (2, 1, W/2), tp = (1, 2, W/2), 3d = (2, 2,
W/4). Each row also gives step 1's loss on both sides (``first_step_loss``).

A cell's step time is the slowest rank's; we report the median over the steps after
``--warmup``, and ratio = ours / torch. Losses: the largest relative difference, over the
steps, from single-process training on the same batches. ``ours_optimizer_ms`` and
``torch_optimizer_ms``: each rank's median optimizer step (ours: its part's push, its
servers' step and the pull; torch: the dp gradient mean and AdamW), the rest of a step being
forward and backward.

Bubble (ours): each stage times its compute (forward and backward of its layers) within the
schedule's wall time (``PipelineParallelModel.last_timing``); measured fraction = 1 - compute
/ wall (``last_bubble_fraction``, compared with (p-1)/(m+p-1)) and idle / compute (compared
with the papers' (p-1)/m), medians over the timed steps. The "bubble sweep" runs ours alone at
p = 2 and 4 stages (W = p, global batch p x 8) with 1F1B and m in {1, 2, 4, 8}. Idle time
includes the transfers through the servers; on a 2-core machine stages also wait for a core.

JSON goes to stdout; progress to stderr. Every child process is started here, dies with this
process and is stopped by PID (``benchmarks/_processes.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from typing import Any

from benchmarks._cpu import Load
from benchmarks._hybrid_cells import (
    cell_row,
    log,
    single_row,
    sweep,
)
from benchmarks._hybrid_ranks import ours_main, torch_main
from benchmarks._processes import install_cleanup
from benchmarks._training import (
    MODELS,
    model_info,
    models_and_worlds,
    parse_list,
    print_report,
    run_main,
    steps_and_warmup,
)

CELLS = ("pp_gpipe", "pp_1f1b", "tp", "3d")
FAMILIES = {"gpt": ("gpt",), "llama": ("llama",), "both": ("gpt", "llama")}
SWEEP_STAGES = (2, 4)
NOTES = {
    "ratio": "ours_ms / torch_ms (lower is better); medians of the slowest rank's step time",
    "cpu": "*_cpu_ms_per_step: CPU ms per step summed over the ranks (ours: servers included,"
    " they run in the ranks' processes), all steps",
    "torch_tp": "attention and MLP both sharded (Megatron): our packed c_attn is rewritten on"
    " the torch side as three Linears q, k, v with the same weights, each ColwiseParallel,"
    " so both sides split attention by heads; a plain ColwiseParallel on the packed c_attn"
    " would not (rank 0 would get all of q and part of k)",
    "llama": "HF LlamaForCausalLM (benchmarks/_llama_stages.py), the same batches as the"
    " GPT: 2 pipeline stages (ours: split_points model.layers.L/2; torch: stage modules with"
    " the same cut), 2 tensor ranks (Llama's own plan on both sides), the other ranks"
    " data-parallel: pp = (2, 1, W/2), tp = (1, 2, W/2), 3d = (2, 2, W/4)",
    "first_step_loss": "step 1's loss, mean over the ranks that report it, per side",
    "micro_batches": "pipeline cells: m = 2 x stages unless --micro-batches; the same m on"
    " both sides; tp: 1",
    "bubble": "ours only; per rank: measured_fraction = 1 - compute / wall of the schedule"
    " (vs theoretical_fraction (p-1)/(m+p-1)), measured_idle_over_compute = (wall - compute)"
    " / compute (vs paper_ratio (p-1)/m); medians over the timed steps. Idle includes the"
    " transfers through the servers and, on this 2-core machine, waiting for a core",
}


# ================================================================================ the ranks
# ================================================================================ the parent
def parent_main(a: argparse.Namespace) -> int:
    install_cleanup()
    models, worlds = models_and_worlds(a, [4])
    cells = parse_list(a.cells)
    for c in cells:
        if c not in CELLS:
            raise SystemExit(f"unknown cell {c!r}; choose from {', '.join(CELLS)}")
    families = FAMILIES[a.family]
    if "llama" in families and importlib.util.find_spec("transformers") is None:
        if a.family == "llama":
            raise SystemExit("--family llama needs transformers (pip install -e '.[dev]')")
        log("transformers is not installed: the Llama cells are left out")
        families = ("gpt",)
    a.steps_for, warmups = steps_and_warmup(a, models, 6, 2)
    t_start, load = time.time(), Load().start()
    import torch  # only for the version

    out: dict[str, Any] = {
        "benchmark": "hybrid",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "notes": NOTES,
        "models": {m: model_info(m, a.steps_for[m], warmups[m]) for m in models},
        "results": [],
        "bubble_sweep": [],
    }
    out["host"]["torch"] = torch.__version__
    if "llama" in families:
        from benchmarks._llama_stages import LLAMA, llama_info

        out["llama_models"] = {m: llama_info(m) for m in models if m in LLAMA}
    for m in models:
        warm = warmups[m]
        if "llama" in families and m not in LLAMA:
            log(f"no Llama of size {m} (benchmarks/_llama_stages.py): its Llama cells are left out")
        for w in worlds:
            for family in (f for f in families if f == "gpt" or m in LLAMA):
                row, ref, single_ms = single_row(family, m, w, warm, a)
                out["results"].append(row)
                for c in cells:
                    out["results"].append(cell_row(family, m, w, c, warm, ref, single_ms, a))
        if not a.no_sweep and "gpt" in families:
            for p in SWEEP_STAGES:
                out["bubble_sweep"] += sweep(m, p, a)
            # interleaved: 2 chunks per rank, so p x 2 virtual stages of at least one block
            for p in (q for q in SWEEP_STAGES if 2 * q <= MODELS[m]["overrides"]["n_layer"]):
                out["bubble_sweep"] += sweep(m, p, a, "interleaved_1f1b")
    out["wall_s"] = round(time.time() - t_start, 1)
    out["foreign_cpu_frac"] = load.stop()
    failed = [r for r in out["bubble_sweep"] if r.get("error")]
    return print_report(out) or (1 if failed else 0)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cells", default=",".join(CELLS), help="default: %(default)s")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=0,
        help="m of the pipeline cells, both sides (default: 2 x stages)",
    )
    p.add_argument(
        "--family",
        default="both",
        choices=list(FAMILIES),
        help="the example GPT, HF LlamaForCausalLM or both (default: %(default)s)",
    )
    p.add_argument("--no-sweep", action="store_true", help="skip the bubble sweep (GPT only)")


def main(argv: list[str] | None = None) -> int:
    return run_main(
        argv,
        __doc__,
        {"_ours": ours_main, "_torch": torch_main},
        (
            ["--cell", "--run", "--schedule", "--micro-batches", "--family"],
            ["--pp", "--tp", "--dp"],
        ),
        "tiny, W=4, 6 steps, a 3-step sweep, GPT and Llama (< 5 minutes)",
        "tiny",
        "4",
        options,
        parent_main,
    )


if __name__ == "__main__":
    sys.exit(main())
