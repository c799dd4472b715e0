"""Train a character-level GPT on Python's own documentation, sharded over paramshard servers.

    python examples/train_gpt.py                        # FSDP, 2 ranks, 2 local servers
    python examples/train_gpt.py --strategy ddp --world-size 4 --steps 200 --model small
    python examples/train_gpt.py --strategy hybrid --pp 2 --tp 2 --world-size 4   # 3D
    python examples/train_gpt.py --servers host1:50051,host2:50051   # use running servers

By default this script is the launcher: it starts ``--world-size`` local shard servers
(``python -m paramshard serve --port 0``) and as many trainer processes (this script again,
with RANK / WORLD_SIZE / PARAMSHARD_SERVERS / PARAMSHARD_RUN set), prints the trainers' output
prefixed with ``[rank R]``, and stops everything when training ends, fails or is interrupted.
It exits non-zero if any rank fails.

Run with RANK set (e.g. by ``paramshard launch``), it is one trainer: it builds its client from
the environment (``ShardingConfiguration.from_env``), trains on its own part of every global
batch, and rank 0 reports progress, the first/last loss and a short greedy sample. It starts
at the model's ``step_count``, so a rank that ``paramshard launch --max-restarts K`` restarted
(ZeRO-1/2, FSDP) resumes its schedule and its batches at the servers' step.
"""

from __future__ import annotations

import argparse
import collections
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

# Runnable as `python examples/train_gpt.py` from a checkout without installing the project.
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from examples.gpt import (  # noqa: E402
    GPT,
    Block,
    CharTokenizer,
    GPTConfig,
    get_batch,
    lm_loss,
    load_text,
    param_groups,
)

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hybrid")
PROGRESS = "@progress "  # rank 0 -> launcher: "redraw the progress line with this text"
TTY_ENV = "TRAIN_GPT_TTY"  # launcher -> rank 0: the launcher's stdout is a terminal
SERVER_START_TIMEOUT_S = 60.0
BETAS = (0.9, 0.95)
STOP_TIMEOUT_S = 5.0


# -- arguments ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Character-level GPT on pydoc text, trained over paramshard shard servers."
    )
    p.add_argument("--strategy", choices=STRATEGIES, default="fsdp", help="default: %(default)s")
    p.add_argument("--world-size", type=int, default=2, help="trainer processes (default: 2)")
    p.add_argument("--pp", type=int, default=1, help="hybrid: pipeline stages (default: 1)")
    p.add_argument("--tp", type=int, default=1, help="hybrid: tensor-parallel ranks (default: 1)")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=4,
        help="hybrid: micro-batches per step in the pipeline (default: 4)",
    )
    p.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b", "interleaved_1f1b"),
        default="1f1b",
        help="hybrid: pipeline schedule (default: 1f1b)",
    )
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (default: 60)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="global batch in sequences, split evenly over the ranks (default: 16)",
    )
    p.add_argument("--block-size", type=int, default=32, help="sequence length (default: 32)")
    p.add_argument("--model", choices=("tiny", "small"), default="tiny", help="default: tiny")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    p.add_argument("--seed", type=int, default=1337, help="default: %(default)s")
    p.add_argument(
        "--servers",
        default=None,
        help="comma-separated host:port of running shard servers (default: start local ones)",
    )
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if os.environ.get("RANK") and os.environ.get("WORLD_SIZE", "").isdigit():
        args.world_size = int(os.environ["WORLD_SIZE"])  # one trainer of a launcher's world
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.strategy != "hybrid" and (args.pp, args.tp) != (1, 1):
        p.error("--pp and --tp need --strategy hybrid")
    if args.pp < 1 or args.tp < 1 or args.world_size % (args.pp * args.tp):
        p.error(
            f"--pp {args.pp} x --tp {args.tp} must divide --world-size {args.world_size}"
            " (the data-parallel size is the rest)"
        )
    if args.strategy == "hybrid":  # each replica's share is cut into the micro-batches
        replicas = args.world_size // (args.pp * args.tp)
        per = replicas * args.micro_batches
        what = f"{replicas} data-parallel replica(s) x --micro-batches {args.micro_batches}"
    else:
        per, what = args.world_size, f"--world-size {args.world_size}"
    if args.batch_size < 1 or args.batch_size % per:
        p.error(f"--batch-size {args.batch_size} must be a positive multiple of {what}")
    if args.block_size < 2:
        p.error("--block-size must be >= 2")
    if args.lr <= 0:
        p.error("--lr must be positive")
    return args


# -- one trainer -------------------------------------------------------------------------------
def build(strategy: str, gpt: GPT, config: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    import strategies as s

    if strategy == "hybrid":  # this rank keeps only its stage and its tensor part of it
        model = s.HybridShardedModel(
            gpt,
            config,
            pipeline_parallel_size=args.pp,
            tensor_parallel_size=args.tp,
            data_parallel_size=-1,
            micro_batch_count=args.micro_batches,
            schedule=args.schedule,
        )
        inner = torch.optim.AdamW(param_groups(model.parameters(), 0.1), lr=args.lr, betas=BETAS)
        return model, s.HybridShardedOptimizer(inner, config)
    model_cls, opt_cls = {
        "ddp": (s.DDPModel, s.DDPOptimizer),
        "zero1": (s.ZeRO1Model, s.ZeRO1Optimizer),
        "zero2": (s.ZeRO2Model, s.ZeRO2Optimizer),
        "fsdp": (s.FSDPModel, s.FSDPOptimizer),
    }[strategy]
    model = model_cls(gpt, config, wrap=(Block,)) if strategy == "fsdp" else model_cls(gpt, config)
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


@torch.no_grad()
def generate(model: Any, tok: CharTokenizer, prompt: str, n: int, block_size: int) -> str:
    """Greedy decoding, one character at a time (each forward gathers what it needs)."""
    ids = tok.encode(prompt)[None, :]
    forward = getattr(model, "predict", model)  # a strategy's, or a plain GPT
    for _ in range(n):
        logits = forward(ids[:, -block_size:])
        ids = torch.cat([ids, logits[:, -1, :].argmax(dim=-1, keepdim=True)], dim=1)
    return tok.decode(ids[0].tolist())


def run_rank(args: argparse.Namespace) -> int:
    from client import restarts
    from strategies import ShardingConfiguration

    if args.servers and not os.environ.get("PARAMSHARD_SERVERS"):
        os.environ["PARAMSHARD_SERVERS"] = args.servers
    if args.rank is not None:
        os.environ.setdefault("RANK", str(args.rank))
    os.environ.setdefault("WORLD_SIZE", str(args.world_size))
    run = os.environ.setdefault("PARAMSHARD_RUN", f"gpt{uuid.uuid4().hex[:8]}")

    config = ShardingConfiguration.from_env(job=f"gpt-{args.strategy}-{run}")
    rank, world = config.rank, config.world_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    text = load_text()
    tok = CharTokenizer(text)
    data = tok.encode(text)
    preset = GPTConfig.tiny if args.model == "tiny" else GPTConfig.small
    cfg = preset(vocab_size=tok.vocab_size, block_size=args.block_size)

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    gpt = GPT(cfg)
    n_params = gpt.num_params()  # counted before wrapping: FSDP frees the local copies
    model, opt = build(args.strategy, gpt, config, args)
    hybrid = args.strategy == "hybrid"
    # Each data-parallel replica trains on its own share of every global batch (in 3D, the
    # ranks of one replica, its stages and tensor ranks, all read that replica's share).
    if hybrid:
        replicas, replica = model.data_parallel_size, model.data_parallel_rank
    else:
        replicas, replica = world, rank
    if args.batch_size % replicas:
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by {replicas} replicas")
    local_batch = args.batch_size // replicas
    # A rank restarted by `paramshard launch --max-restarts` (or a job launched again with the
    # same PARAMSHARD_RUN) finds its model at the servers' step: the schedule and the data
    # resume there, so every step sees the learning rate and batch an uninterrupted run would.
    start = getattr(model, "step_count", 0)
    for group in opt.param_groups:
        group.setdefault("initial_lr", group["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.steps), last_epoch=start - 1)
    gen = torch.Generator().manual_seed(args.seed + 1 + replica)
    for _ in range(start):  # the batches of the steps already taken
        get_batch(data, local_batch, args.block_size, gen)
    # A restarted rank cannot replay a collective the others finished before it died, so with
    # --max-restarts the loop makes none: rank 0 reports the loss of its own share.
    own_loss = restarts.max_restarts() > 0
    client = config.client

    tty_mode = "direct" if sys.stdout.isatty() else "relay" if os.environ.get(TTY_ENV) else ""
    if rank == 0:
        layout = f" (pp {args.pp} x tp {args.tp} x dp {replicas})" if hybrid else ""
        print(
            f"{args.strategy}: GPT {args.model} ({n_params:,} parameters, "
            f"vocab {tok.vocab_size}), world size {world}{layout}, global batch"
            f" {args.batch_size} x {args.block_size} tokens, {len(client.spec.addresses)} servers"
            + (", loss of rank 0's share" if own_loss else ""),
            flush=True,
        )
    if start:
        print(
            f"rank {rank}: resumed at step {start}, the servers' step"
            f" (restart {restarts.restart_count()})",
            flush=True,
        )

    losses: list[float] = []
    comm = 0.0
    began = time.perf_counter()
    for step in range(start, args.steps):
        x, y = get_batch(data, local_batch, args.block_size, gen)
        if hybrid:  # the pipeline schedule: forward and backward, the global batch's loss
            mean_loss = model.forward_backward(x, y)
            t0 = time.perf_counter()
            model.clip_grad_norm_(1.0)
            opt.step()
        else:
            loss = lm_loss(model(x), y)
            loss.backward()
            t0 = time.perf_counter()
            model.clip_grad_norm_(1.0)
            opt.step()
            if own_loss:
                mean_loss = float(loss.detach())
            else:
                mean_loss = float(client.all_reduce(loss.detach().reshape(1), "mean")[0])
        comm += time.perf_counter() - t0
        opt.zero_grad()
        sched.step()
        losses.append(mean_loss)
        if rank == 0:
            elapsed = time.perf_counter() - began
            done = step + 1
            line = (
                f"step {done:4d}/{args.steps}  loss {mean_loss:.4f}  "
                f"{len(losses) * args.batch_size * args.block_size / elapsed:7.0f} tok/s  "
                f"comm {100 * comm / elapsed:3.0f}%"
            )
            if tty_mode:
                width = 20
                bar = "#" * (width * done // args.steps)
                line = f"[{bar:<{width}}] {line}"
                if tty_mode == "direct":
                    end = "\n" if done == args.steps else ""
                    print(f"\r\033[K{line}", end=end, flush=True)
                else:
                    print(PROGRESS + line, flush=True)
            elif done % 10 == 0 or done in (1, args.steps):
                print(line, flush=True)

    if hybrid:  # every rank gathers the whole model (collective); rank 0 samples from it
        whole = GPT(cfg)
        whole.load_state_dict(model.state_dict())
        model = whole
    if rank != 0:
        return 0
    elapsed = time.perf_counter() - began
    if not losses:
        print(f"done: the servers were at step {start} already", flush=True)
        return 0
    k = min(5, len(losses))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(
        f"done: {len(losses)} steps in {elapsed:.1f} s, "
        f"{len(losses) * args.batch_size * args.block_size / elapsed:.0f} tok/s, "
        f"{100 * comm / elapsed:.0f}% of the time in communication",
        flush=True,
    )
    print(f"first loss {first:.4f} -> last loss {last:.4f} (mean of {k} steps each)", flush=True)
    sample = generate(model, tok, "The ", 80, args.block_size)
    print(f"sample: {sample!r}", flush=True)
    if start and len(losses) < 2 * k:
        print(f"OK: resumed at step {start}; too few steps left to judge the loss", flush=True)
        return 0
    if not last < first:
        print("FAILED: the loss did not go down", flush=True)
        return 1
    print("OK: the loss went down", flush=True)
    return 0


# -- the launcher ------------------------------------------------------------------------------
def _parent_death_signal() -> Any:
    """Linux: a preexec_fn that makes the child get SIGTERM when the launcher dies (even by
    SIGKILL), so no server or rank outlives it. libc is loaded here, before forking, so the
    child only makes one system call between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (ImportError, OSError):  # best effort; cleanup() is the main mechanism
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,  # Ctrl-C reaches only the launcher, which stops the rest
        preexec_fn=_parent_death_signal(),  # noqa: PLW1509 - one prctl call, nothing to lock
    )


def _reader(proc: subprocess.Popen, out: queue.Queue, tag: Any) -> threading.Thread:
    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put((tag, line.rstrip("\n")))
        out.put((tag, None))

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def start_servers(n: int, procs: list[subprocess.Popen]) -> list[str]:
    """Starts n local shard servers; returns their addresses once each says it listens."""
    lines: queue.Queue = queue.Queue()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for i in range(n):
        procs.append(_spawn([sys.executable, "-m", "paramshard", "serve", "--port", "0"], env))
        _reader(procs[-1], lines, i)
    addresses: list[str | None] = [None] * n
    logs: dict[int, collections.deque] = {i: collections.deque(maxlen=20) for i in range(n)}
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while None in addresses:
        try:
            i, line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            late = [i for i, a in enumerate(addresses) if a is None]
            raise RuntimeError(
                f"servers {late} did not start within {SERVER_START_TIMEOUT_S:g} s:"
                f" {[list(logs[i]) for i in late]}"
            ) from None
        if line is None:
            raise RuntimeError(
                f"server {i} exited while starting (code {procs[i].wait()}):\n" + "\n".join(logs[i])
            )
        logs[i].append(line)
        m = re.search(r"listening on (\S+)", line)
        if m and addresses[i] is None:
            addresses[i] = m.group(1)

    # Keep draining their output (discarded) so a full pipe never blocks a server.
    def drain() -> None:
        while True:
            lines.get()

    threading.Thread(target=drain, daemon=True).start()
    return [a for a in addresses if a is not None]


def cleanup(procs: list[subprocess.Popen]) -> None:
    """SIGTERM everything still running, wait a bounded time, then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"train_gpt: pid {p.pid} did not die", file=sys.stderr)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    tty = sys.stdout.isatty()
    servers: list[subprocess.Popen] = []
    trainers: list[subprocess.Popen] = []

    def on_sigterm(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if args.servers:
            addresses = [a.strip() for a in args.servers.split(",") if a.strip()]
        else:
            addresses = start_servers(args.world_size, servers)
            print(f"started {len(addresses)} shard servers: {', '.join(addresses)}", flush=True)
        run = f"gpt{uuid.uuid4().hex[:8]}"
        base_env = {
            **os.environ,
            "WORLD_SIZE": str(args.world_size),
            "PARAMSHARD_SERVERS": ",".join(addresses),
            "PARAMSHARD_RUN": run,
            "PYTHONUNBUFFERED": "1",
        }
        base_env.pop(TTY_ENV, None)
        out: queue.Queue = queue.Queue()
        for r in range(args.world_size):
            env = {**base_env, "RANK": str(r), **({TTY_ENV: "1"} if tty and r == 0 else {})}
            trainers.append(
                _spawn([sys.executable, os.path.abspath(__file__), *argv, "--rank", str(r)], env)
            )
            _reader(trainers[-1], out, r)

        open_streams, in_place = set(range(args.world_size)), False
        while open_streams:
            r, line = out.get()
            if line is None:
                open_streams.discard(r)
                code = trainers[r].wait()
                if code != 0:
                    if in_place:
                        print()
                    print(
                        f"train_gpt: rank {r} failed with exit code {code}; stopping",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
                continue
            if line.startswith(PROGRESS):
                if tty:
                    print(f"\r\033[K[rank {r}] {line[len(PROGRESS) :]}", end="", flush=True)
                    in_place = True
                continue
            if in_place:
                print()
                in_place = False
            print(f"[rank {r}] {line}", flush=True)
        return 0
    except KeyboardInterrupt:
        print("\ntrain_gpt: interrupted; stopping", file=sys.stderr, flush=True)
        return 130
    except RuntimeError as exc:
        print(f"train_gpt: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        cleanup(trainers + servers)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.rank is not None or os.environ.get("RANK"):
        return run_rank(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
