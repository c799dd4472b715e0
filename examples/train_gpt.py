"""Train a character-level GPT on Python's own documentation, sharded over paramshard servers.

    python examples/train_gpt.py                        # FSDP, 2 ranks, 2 local servers
    python examples/train_gpt.py --strategy ddp --world-size 4 --steps 200 --model small
    python examples/train_gpt.py --strategy hybrid --pp 2 --tp 2 --world-size 4   # 3D
    python examples/train_gpt.py --steps 2000 --target-loss 1.9   # until validation loss < 1.9
    paramshard launch --nproc 2 examples/train_gpt.py            # the same as the first line

Run without RANK set, the script hands itself to ``paramshard launch --nproc WORLD_SIZE`` (with
``--servers`` when given), which starts the shard servers and one copy of this script per rank.
Each rank builds its client from the environment (``ShardingConfiguration.from_env``) and
trains on its share of every global batch through ``train_with_recovery``, so a shard server
killed mid-training costs no work once it is back at its address (``--max-server-restarts K``
has the launcher start its local servers again; with ``--replicate-every 1`` at most one step
is replayed; see examples/demo.py). Rank 0 shows a tqdm bar (a line every ``--log-every``
steps when its output is not a terminal), the validation loss every ``--eval-every`` steps,
and a sample at the end, from the model gathered out of the servers as
``train_with_recovery``'s ``finish``: a server that dies once training has ended is recovered
too.
Batches are a function of the step, and training starts at the model's ``step_count``, so a
rank restarted by ``paramshard launch --max-restarts K`` (ZeRO-1/2, FSDP) resumes where the
servers are. ``--elastic`` (ZeRO-1/2, FSDP; docs/elastic.md) lets ranks leave and join between
steps: each step's global batch is drawn whole and each member trains its
``model.batch_part`` of it, so the run does not depend on who was there.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from typing import Any

import torch
from progress import progress_bar, summarize  # this script's folder

from paramshard.models.gpt import (
    GPT,
    Block,
    CharTokenizer,
    GPTConfig,
    generate,
    get_batch,
    lm_loss,
    load_text,
    param_groups,
    split_text,
)

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hybrid")
BETAS = (0.9, 0.95)
EVAL_BATCHES = 8  # validation batches per data-parallel rank
SAMPLE_TEMPERATURE = 0.8


def job_name(strategy: str, run: str) -> str:
    """The job's name on the servers (examples/demo.py inspects and exports it)."""
    return f"gpt-{strategy}-{run}"


def model_config(model: str, vocab_size: int, block_size: int) -> GPTConfig:
    preset = GPTConfig.tiny if model == "tiny" else GPTConfig.small
    return preset(vocab_size=vocab_size, block_size=block_size)


def validation_batches(
    val_data: torch.Tensor, local_batch: int, block_size: int, seed: int, replica: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out batches data-parallel rank ``replica`` validates on (the same every time)."""
    gen = torch.Generator().manual_seed(seed + 7919 + replica)
    return [get_batch(val_data, local_batch, block_size, gen) for _ in range(EVAL_BATCHES)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Character-level GPT on pydoc text, trained over paramshard shard servers."
    )
    arg = p.add_argument
    arg("--strategy", choices=STRATEGIES, default="fsdp", help="default: %(default)s")
    arg("--world-size", type=int, default=2, help="trainer processes (default: 2)")
    arg("--pp", type=int, default=1, help="hybrid: pipeline stages (default: 1)")
    arg("--tp", type=int, default=1, help="hybrid: tensor-parallel ranks (default: 1)")
    arg("--micro-batches", type=int, default=4, help="hybrid: micro-batches per step (4)")
    arg("--schedule", choices=("gpipe", "1f1b", "interleaved_1f1b"), default="1f1b")
    arg("--steps", type=int, default=60, help="optimizer steps, at most (default: 60)")
    arg("--batch-size", type=int, default=16, help="global batch in sequences (default: 16)")
    arg("--block-size", type=int, default=32, help="sequence length (default: 32)")
    arg("--model", choices=("tiny", "small"), default="tiny", help="default: tiny")
    arg("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    arg("--seed", type=int, default=1337, help="default: %(default)s")
    arg("--target-loss", type=float, default=None, help="stop once validation loss is below")
    arg("--eval-every", type=int, default=50, help="steps between validations (default: 50)")
    arg("--replicate-every", type=int, default=0, help="neighbour replicas every k steps")
    arg("--checkpoint-every", type=int, default=0, help="snapshots every k steps (0: none)")
    arg("--log-every", type=int, default=10, help="progress line period without a terminal")
    arg("--servers", default=None, help="host:port,... of running servers (default: start)")
    arg("--elastic", action="store_true", help="ranks may leave and join (ZeRO-1/2, FSDP)")
    arg("--min-nproc", type=int, default=None, help="--elastic: fewest ranks a step trains with")
    arg("--max-restarts", type=int, default=0, help="restart a failed rank (ZeRO-1/2, FSDP)")
    arg("--max-server-restarts", type=int, default=0, help="start a dead local server again")
    args = p.parse_args(argv)
    args.elastic = args.elastic or os.environ.get("PARAMSHARD_ELASTIC") == "1"
    if os.environ.get("WORLD_SIZE", "").isdigit() and os.environ.get("RANK"):
        args.world_size = int(os.environ["WORLD_SIZE"])  # one trainer of a launcher's world
    for name in ("world_size", "steps", "eval_every", "log_every", "block_size", "pp", "tp"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.strategy != "hybrid" and (args.pp, args.tp) != (1, 1):
        p.error("--pp and --tp need --strategy hybrid")
    if args.elastic and args.strategy in ("ddp", "hybrid"):
        p.error(f"--elastic needs zero1, zero2 or fsdp: {args.strategy} keeps state in its ranks")
    if args.world_size % (args.pp * args.tp):
        p.error(f"--pp {args.pp} x --tp {args.tp} must divide --world-size {args.world_size}")
    if args.strategy == "hybrid":
        if args.target_loss is not None:
            p.error("--target-loss: validation runs with ddp, zero1, zero2 and fsdp")
        replicas = args.world_size // (args.pp * args.tp)
        per, what = replicas * args.micro_batches, f"{replicas} replica(s) x --micro-batches"
    else:
        per, what = args.world_size, f"--world-size {args.world_size}"
    if args.elastic and args.batch_size >= per:
        per = 1  # each step's members cut it, parts differing by one row at most
    if args.batch_size < 1 or args.batch_size % per:
        p.error(f"--batch-size {args.batch_size} must be a positive multiple of {what} ({per})")
    if args.lr <= 0:
        p.error("--lr must be positive")
    return args


def build(gpt: GPT, config: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    import paramshard.strategies as s

    if args.strategy == "hybrid":  # this rank keeps only its stage and its tensor part of it
        model = s.HybridShardedModel(
            gpt, config, pipeline_parallel_size=args.pp, tensor_parallel_size=args.tp,
            data_parallel_size=-1, micro_batch_count=args.micro_batches, schedule=args.schedule,
        )  # fmt: skip
        inner = torch.optim.AdamW(param_groups(model.parameters(), 0.1), lr=args.lr, betas=BETAS)
        return model, s.HybridShardedOptimizer(inner, config)
    model_cls, opt_cls = s.DATA_PARALLEL[args.strategy]  # e.g. (FSDPModel, FSDPOptimizer)
    wrap = {"wrap": (Block,)} if args.strategy == "fsdp" else {}
    model = model_cls(gpt, config, **wrap)
    # Param groups come from the wrapped model's own parameters (decay on matrices only).
    inner = torch.optim.AdamW(model.module.param_groups(0.1), lr=args.lr, betas=BETAS)
    return model, opt_cls(inner, config)


def lr_lambda(steps: int) -> Any:
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:  # linear warmup, then linear decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        return 1.0 - 0.9 * (step - warmup) / max(1, steps - warmup)

    return factor


def run_rank(args: argparse.Namespace) -> int:
    from paramshard.client import restarts
    from paramshard.strategies import RecoveryReport, ShardingConfiguration, train_with_recovery

    config = ShardingConfiguration.from_env(job="gpt")  # its client knows the launcher's run id
    job = job_name(args.strategy, config.client.run_id)
    config = dataclasses.replace(config, job=job, replicate_every=args.replicate_every)
    rank, world, client = config.rank, config.world_size, config.client
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if rank == 0:  # train_with_recovery's "recovered" lines, printed above the bar
        logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)

    text = load_text()
    tok = CharTokenizer(text)
    train_data, val_data = split_text(tok.encode(text))
    cfg = model_config(args.model, tok.vocab_size, args.block_size)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    gpt = GPT(cfg)
    n_params = gpt.num_params()  # counted before wrapping: FSDP frees the local copies
    model, opt = build(gpt, config, args)
    hybrid = args.strategy == "hybrid"
    # Each data-parallel replica trains on its own share of every global batch (in 3D, the
    # ranks of one replica, its stages and tensor ranks, all read that replica's share).
    replicas, replica = (
        (model.data_parallel_size, model.data_parallel_rank) if hybrid else (world, rank)
    )
    local_batch = args.batch_size // replicas
    # A restarted rank (or a run launched again with the same PARAMSHARD_RUN) finds the model
    # at the servers' step: the schedule and the batches continue there.
    start = getattr(model, "step_count", 0)  # DDP keeps its state here: it starts at 0
    for group in opt.param_groups:
        group.setdefault("initial_lr", group["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.steps), last_epoch=start - 1)
    # A restarted rank meets the others in a new epoch as train_with_recovery starts, so the
    # loss's all-reduce needs no care; an elastic job's collectives go over each step's
    # members (model.step_group), a restart included.
    elastic = getattr(model, "elastic", False)
    val_batches = validation_batches(val_data, local_batch, args.block_size, args.seed, replica)
    if elastic:  # one held-out global batch, cut among each step's members like the others
        val_batches = validation_batches(val_data, args.batch_size, args.block_size, args.seed, 0)
    if rank == 0:
        layout = f" (pp {args.pp} x tp {args.tp} x dp {replicas})" if hybrid else ""
        layout = f", elastic (at most {world} ranks)" if elastic else layout
        print(
            f"{args.strategy}: GPT {args.model} ({n_params:,} parameters, vocab"
            f" {tok.vocab_size}), world size {world}{layout}, global batch {args.batch_size} x"
            f" {args.block_size} tokens, {len(client.spec.addresses)} servers, job {config.job}",
            flush=True,
        )
    if start:
        print(f"rank {rank}: resumed at step {start}, the servers' step"
              f" (restart {restarts.restart_count()})", flush=True)  # fmt: skip

    def mean(value: float, rows: int | None = None) -> float:
        """Over the data-parallel ranks (one replica's in 3D); elastic: the step's members,
        weighted by their rows of the global batch (``rows``: another batch's size)."""
        if elastic:
            return model.batch_mean(value, rows)
        return float(client.all_reduce(torch.tensor([value]), "mean")[0])

    comm = 0.0

    def train_step(step: int) -> float:
        nonlocal comm
        if elastic:  # the step's global batch, whoever trains it: this rank's part of it
            gen = torch.Generator().manual_seed(args.seed + 1 + step)
            x, y = get_batch(train_data, args.batch_size, args.block_size, gen)
            part = model.batch_part(args.batch_size)
            x, y = x[part], y[part]
        else:
            gen = torch.Generator().manual_seed(args.seed + 1 + step * replicas + replica)
            x, y = get_batch(train_data, local_batch, args.block_size, gen)
        if hybrid:  # the pipeline schedule: forward and backward, the global batch's loss
            loss = model.forward_backward(x, y)
        else:
            out = lm_loss(model(x), y)
            out.backward()
            loss = out.item()
        t0 = time.perf_counter()
        model.clip_grad_norm_(1.0)
        opt.step()
        loss = loss if hybrid else mean(loss)
        comm += time.perf_counter() - t0
        opt.zero_grad()
        sched.step()
        return loss

    val_losses: dict[int, float] = {}

    def validate(step: int, _loss: float) -> bool:
        done = step + 1
        if hybrid or (done % args.eval_every and done != args.steps):
            return False
        batches, rows = val_batches, None
        if elastic:  # this rank's rows of the held-out global batch, among the step's members
            part, rows = model.joined.part(rank, args.batch_size), args.batch_size
            batches = [(x[part], y[part]) for x, y in val_batches]
        with torch.no_grad():
            local = sum(lm_loss(model(x), y).item() for x, y in batches) / len(batches)
        val_losses[done] = val = mean(local, rows)
        if rank == 0:
            bar.write(f"step {done}: validation loss {val:.4f}", file=sys.stdout)
        return args.target_loss is not None and val < args.target_loss

    whole: GPT | None = None  # the trained model, gathered from the servers for the sample

    def gather() -> None:
        """Rank 0 copies the trained model out of the servers (in 3D every rank takes part:
        the gather is collective); run as ``finish``, so a server dying now is recovered."""
        nonlocal whole
        if hybrid or rank == 0:
            state = model.state_dict()
            whole = GPT(cfg)
            whole.load_state_dict(state)

    bar = progress_bar(args, start, enabled=rank == 0)
    began = time.perf_counter()
    with bar:
        if args.strategy == "ddp":  # its parameters live in the trainers: nothing to recover
            report = RecoveryReport()
            for step in range(args.steps):
                report.losses[step] = loss = train_step(step)
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                bar.update()
                if validate(step, loss):
                    break
        else:
            report = train_with_recovery(
                model, train_step, args.steps, checkpoint_every=args.checkpoint_every,
                progress=bar, should_stop=validate, scheduler=sched,
                finish=None if elastic else gather,  # elastic: its leader samples the servers
            )  # fmt: skip
    elapsed = time.perf_counter() - began
    end = start + len(report.losses) if args.strategy == "ddp" else model.step_count
    if elastic:  # the last step's leader (rank 0 may be gone); none for a rank that came
        joined = model.joined  # once the job had ended (it resumed at the last step)
        reports = joined is not None and joined.leader == rank
    else:
        reports = rank == 0
    if not reports:
        return 0
    trained = whole if whole is not None else model  # DDP's model is in the trainer already

    def sample() -> str:
        gen = torch.Generator().manual_seed(args.seed)
        return generate(trained, tok, "The ", 80, args.block_size, SAMPLE_TEMPERATURE, gen)

    return summarize(args, report, start, end, elapsed, comm, val_losses, sample)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if os.environ.get("RANK"):
        return run_rank(args)
    from paramshard.cli import main as paramshard

    launch = ["--servers", args.servers] if args.servers else []
    if args.elastic:
        launch += ["--elastic"] + (["--min-nproc", str(args.min_nproc)] if args.min_nproc else [])
    if args.max_restarts:
        launch += ["--max-restarts", str(args.max_restarts)]
    if args.max_server_restarts:
        launch += ["--max-server-restarts", str(args.max_server_restarts)]
    return paramshard(["launch", "--nproc", str(args.world_size), *launch, __file__, *argv])


if __name__ == "__main__":
    sys.exit(main())
