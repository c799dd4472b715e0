"""``make demo``: train the example GPT while looking into the job, killing a server, and keeping
the model, on one machine in about two minutes.

1. starts 2 shard servers (``paramshard serve``, one snapshot directory);
2. trains the GPT on 2 FSDP ranks (``paramshard launch --servers ... examples/train_gpt.py``),
   with neighbour replicas every step (``--replicate-every 1``), until the held-out validation
   loss is below ``--target-loss``;
3. meanwhile looks into the live job (``paramshard inspect``) and, a little later, SIGKILLs
   server 1 and starts an empty one at its address: the ranks recover from server 0's replica
   of server 1's slices and continue from the newest replica server 0 held when server 1
   died, which is normally the step they were on (the step in flight is redone). Replicas
   are sent after each step, in the background (docs/design.md §5.2): a kill that lands
   between a step and its replica's arrival redoes that step too, and the demo says so;
4. snapshots the job (``paramshard snapshot``) and exports it to safetensors
   (``paramshard export``);
5. loads the export into a plain torch GPT, measures its validation loss on the trainers'
   validation batches and samples from it.

It prints PASS when every stage happened and the loss is below the threshold, else FAIL with
the reason, and exits 1. ``--workdir DIR`` keeps the servers' logs, the snapshot and the export.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import train_gpt  # this script's folder

from paramshard.models.gpt import GPT, CharTokenizer, generate, lm_loss, load_text, split_text

_ROOT = Path(__file__).resolve().parents[1]  # the checkout: the demo runs its example script

WORLD = 2  # trainer ranks and shard servers
START_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 900.0  # the whole training, bounded
RECOVERED = re.compile(r"^\[rank 0\] rank 0: recovered in ([\d.]+) s: the servers are at step"
                       r" (\d+).*\((\d+) steps replayed\)")  # fmt: skip
TRAINED = re.compile(r"^\[rank 0\] steps (\d+)\.\.(\d+) trained \((\w+)\), the servers at"
                     r" version (\d+)")  # fmt: skip
VALIDATION = re.compile(r"^\[rank 0\] step (\d+): validation loss ([\d.]+)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arg = p.add_argument
    arg("--target-loss", type=float, default=1.70, help="validation loss to reach (1.70)")
    arg("--max-steps", type=int, default=1000, help="give up after this many steps (1000)")
    arg("--batch-size", type=int, default=64, help="global batch in sequences (64)")
    arg("--eval-every", type=int, default=50, help="steps between validations (50)")
    arg("--inspect-at", type=int, default=50, help="run paramshard inspect at this step (50)")
    arg("--kill-at", type=int, default=120, help="SIGKILL server 1 at this step (120)")
    arg("--workdir", type=Path, default=None, help="keep logs, snapshot, export here")
    args = p.parse_args(argv)
    if not 0 < args.inspect_at < args.kill_at < args.max_steps:
        p.error("need 0 < --inspect-at < --kill-at < --max-steps")
    return args


def say(text: str) -> None:
    print(f"\n== demo: {text}", flush=True)


def paramshard(*argv: str) -> str:
    """Runs one ``paramshard`` command in this process (the same ``main`` as ``python -m
    paramshard``, without a new interpreter's start: the live inspection must not hold the demo
    back while training goes on); returns its output (raises with it on failure)."""
    from paramshard.cli import main as paramshard_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = paramshard_main(list(argv))
        except SystemExit as exc:  # argparse, on bad arguments
            code = exc.code if isinstance(exc.code, int) else 2
    if code:
        raise RuntimeError(f"{' '.join(argv[:2])} failed: {out.getvalue()}{err.getvalue()}")
    return out.getvalue()


class Server:
    """One ``paramshard serve`` on a fixed port, so an empty one can take a dead one's place."""

    def __init__(self, index: int, workdir: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.index, self.workdir = index, workdir
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        from paramshard.local_servers import wait_serving

        log = (self.workdir / f"server-{self.index}.log").open("a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "paramshard", "serve", "--port", str(self.port),
             "--snapshot-dir", str(self.workdir / "snapshots")],
            cwd=_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        wait_serving([self.address], None, START_TIMEOUT_S, unreachable_s=START_TIMEOUT_S)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def server_step(client: Any, job: str) -> int:
    """The job's version on the servers (the steps taken); -1 before it registered."""
    from paramshard.client import ShardClientError, tools

    try:
        return min(p.version for p in tools.job_params(client, job))
    except (KeyError, ShardClientError, ValueError):
        return -1


def replica_version(client: Any, job: str) -> int:
    """The newest version of server 1's slices that server 0 holds (-1: none yet)."""
    from paramshard.client import ShardClientError
    from paramshard.protos import shard_pb2 as pb

    try:
        reply = client.call(0, "ListReplicas", pb.ListReplicasRequest(job=job))
    except ShardClientError:
        return -1
    held = [r.version for r in reply.replicas if not r.own and r.source_index == 1]
    return max(held, default=-1)


def train(args: argparse.Namespace, servers: list[Server], job: str, run: str) -> dict[str, Any]:
    """Launches the trainers; inspects, kills and restarts server 1 on the way. Returns what
    happened (the trainers' output is printed as it comes)."""
    from paramshard.client import ClusterSpec, ShardClient

    addresses = ",".join(s.address for s in servers)
    cmd = [
        sys.executable, "-m", "paramshard", "launch", "--nproc", str(WORLD), "--servers",
        addresses, "--run-id", run, str(_ROOT / "examples" / "train_gpt.py"), "--strategy",
        "fsdp", "--steps", str(args.max_steps), "--batch-size", str(args.batch_size),
        "--target-loss", str(args.target_loss), "--eval-every", str(args.eval_every),
        "--replicate-every", "1", "--log-every", "25",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, bufsize=1,
    )  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)],
                     daemon=True).start()  # fmt: skip
    seen: dict[str, Any] = {"val": {}}
    client = ShardClient(ClusterSpec([s.address for s in servers]), timeout_s=10, retries=0)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while True:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line:
                print(line, end="", flush=True)
                if m := RECOVERED.match(line):
                    resumed, replayed = int(m.group(2)), int(m.group(3))
                    # killed_at is the servers' version when the demo killed. The last step
                    # they committed may still have been in flight on the ranks (its update
                    # on the servers, not yet in their replicas): the ranks redo it, so only
                    # the steps before it count
                    killed_at = seen.get("killed_at", resumed + 1)
                    lost = replayed + max(0, killed_at - 1 - resumed)
                    # what no recovery can bring back: the steps past the newest replica
                    # server 0 held at the kill (their replicas were still on the way)
                    unreplicated = max(0, killed_at - seen.get("replica_at", killed_at))
                    seen.update(resumed=resumed, lost=lost, unreplicated=unreplicated,
                                recovery_s=float(m.group(1)))  # fmt: skip
                    say(f"recovered in {m.group(1)} s: step {resumed + 1} continues,"
                        f" {lost} steps lost"
                        + (f" (replica of step {killed_at} still on the way at the kill)"
                           if unreplicated else ""))  # fmt: skip
                elif m := TRAINED.match(line):
                    seen["trained"] = tuple(int(m.group(i)) for i in (1, 2, 4))
                    seen["continuous"] = m.group(3) == "continuous"
                elif m := VALIDATION.match(line):
                    seen["val"][int(m.group(1))] = float(m.group(2))
                    # training stops after this step: a kill now would be recovered (the
                    # trainers gather the model in train_with_recovery's finish) but would
                    # not show training going on
                    seen["ending"] = float(m.group(2)) < args.target_loss
            if time.monotonic() > deadline:
                raise RuntimeError(f"training took longer than {RUN_TIMEOUT_S:g} s")
            if "killed_at" in seen:
                continue
            step = server_step(client, job)
            if step >= args.inspect_at and "inspected" not in seen:
                seen["inspected"] = step
                say(f"paramshard inspect {job}  (live, at step {step})")
                print(paramshard("inspect", job, "--servers", addresses), end="", flush=True)
            elif args.kill_at <= step < args.max_steps and not seen.get("ending"):
                victim = servers[1]
                assert victim.proc is not None
                pid = victim.proc.pid
                replica_at = replica_version(client, job)
                victim.stop(signal.SIGKILL)
                seen["killed_at"], seen["replica_at"] = step, replica_at
                say(f"killed server 1 (pid {pid}) at step {step} with SIGKILL"
                    f" (server 0 held its replica of step {replica_at})")  # fmt: skip
                victim.start()
                assert victim.proc is not None
                say(f"started an empty server 1 at {victim.address} (pid {victim.proc.pid})")
        seen["returncode"] = proc.wait(timeout=60)
    finally:
        client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    return seen


def check_export(path: Path, args: argparse.Namespace) -> tuple[float, str]:
    """The exported model in plain torch: its loss on the trainers' validation batches, and a
    sample."""
    from safetensors.torch import load_file

    # A 0.87M-parameter model: one torch thread is the fastest here, idle (0.3 s against 0.4
    # with two) and on a loaded machine (1 s against 25-60 s: OpenMP threads wait for cores)
    torch.set_num_threads(1)
    text = load_text()
    tok = CharTokenizer(text)
    _, val_data = split_text(tok.encode(text))
    cfg = train_gpt.model_config("tiny", tok.vocab_size, 32)
    gpt = GPT(cfg)
    gpt.load_state_dict(load_file(path))
    gpt.eval()
    batches = [
        b for r in range(WORLD) for b in train_gpt.validation_batches(
            val_data, args.batch_size // WORLD, cfg.block_size, 1337, r)
    ]  # fmt: skip
    with torch.no_grad():
        val = sum(lm_loss(gpt(x), y).item() for x, y in batches) / len(batches)
    sample = generate(gpt, tok, "The ", 240, cfg.block_size, train_gpt.SAMPLE_TEMPERATURE,
                      torch.Generator().manual_seed(0))  # fmt: skip
    return val, sample


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="paramshard-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run = f"demo{int(time.time()) % 100000}"
    job = train_gpt.job_name("fsdp", run)
    servers = [Server(i, workdir) for i in range(WORLD)]
    failures: list[str] = []
    try:
        say(f"starting {WORLD} shard servers (logs and snapshots in {workdir})")
        for s in servers:
            s.start()
        print(f"servers: {', '.join(s.address for s in servers)}")
        say(f"training job {job} until validation loss < {args.target_loss}"
            f" (at most {args.max_steps} steps)")  # fmt: skip
        seen = train(args, servers, job, run)
        if seen.get("returncode") != 0:
            failures.append(f"training exited with code {seen.get('returncode')}")
        if "killed_at" not in seen:
            failures.append("server 1 was not killed (training ended before --kill-at)")
        elif seen.get("lost", 1) > seen.get("unreplicated", 0):
            failures.append(f"recovery: {seen.get('lost', 'unknown')} steps lost")
        first, last, version = seen.get("trained", (0, 0, -1))
        if not seen.get("continuous") or version != last:
            failures.append(f"steps {first}..{last} vs version {version}: not continuous")
        addresses = ",".join(s.address for s in servers)
        say(f"paramshard snapshot {job} --tag final")
        print(paramshard("snapshot", job, "--tag", "final", "--servers", addresses), end="")
        print(f"snapshot: {workdir / 'snapshots' / job / 'final'}")
        out = workdir / "gpt.safetensors"
        say(f"paramshard export {job} --out {out}")
        print(paramshard("export", job, "--out", str(out), "--servers", addresses), end="")
    finally:
        for s in servers:
            s.stop()
    say("the export in plain torch: GPT().load_state_dict(safetensors.torch.load_file(...))")
    val, sample = check_export(out, args)
    trained_val = seen["val"][max(seen["val"])] if seen["val"] else float("nan")
    print(f"sample: {sample!r}")
    print(f"validation loss: {val:.4f} (the trainers measured {trained_val:.4f})")
    if not val < args.target_loss:
        failures.append(f"validation loss {val:.4f} is not below {args.target_loss}")
    verdict = "PASS" if not failures else "FAIL: " + "; ".join(failures)
    say(f"validation loss {val:.4f} vs threshold {args.target_loss}: {verdict}"
        f" ({time.monotonic() - began:.0f} s in all)")  # fmt: skip
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
