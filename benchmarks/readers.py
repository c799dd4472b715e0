"""What readers beside training cost the trainer: one server, a trainer and read-token pulls.

    python -m benchmarks.readers [--quick] [--reps 3] [--steps 12] [--warmup 2]
                                 [--buffers 12] [--numel 6000000] [--readers 8]
                                 [--wait-quiet S]

One ``paramshard serve`` process with a token file (a ``train`` and a ``read`` token). A
trainer process (the ``train`` token, shared memory on as by default) registers ``--buffers``
Adam buffers of ``--numel`` float32 each and sets them, then runs ``--steps`` steps: a
gradient pushed to every buffer, one ``Step`` of all of them, every buffer pulled at the new
version. Beside it, in the conditions:

- ``none`` (the reference): nothing else.
- ``shm``: a process of ``--readers`` threads, each with its own client and the ``read``
  token, pulling the buffers one after another (the current version, ``pull_params(...,
  0)``) for as long as the trainer steps; shared memory on, as a reader on the server's host
  gets by default.
- ``inband``: the same readers with ``PARAMSHARD_SHM=0``, every pull's bytes in gRPC
  messages, as readers on another host get them.

Every trial starts a fresh server; the conditions' order turns from one repetition to the
next. Per trial: the trainer's median step after ``--warmup`` steps and the median of each
phase (push, step, pull), the readers' pulls and bytes a second, and the CPU seconds a step
of the server, the trainer and the readers' process (``/proc``, from the trainer's first
step to its last). ``ratio``: a condition's median step over ``none``'s in the same
repetition. The trainer and the readers share the machine's cores with the server: on two
cores this is the field check's case of docs/security.md (seventeenth round).

``--quick``: 4 buffers of 100,000 floats, 2 readers, 5 steps, one repetition (seconds).
JSON to stdout, progress to stderr; every child is started here and stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._cpu import proc_cpu_s, wait_quiet
from benchmarks._processes import (
    Child,
    child_env,
    child_guard,
    emit,
    install_cleanup,
    logger,
    read_line,
    run_child,
    serve_processes,
    stop_all,
    wait_parent_eof,
)
from benchmarks._scale_memory import loadavg, machine, write_report
from benchmarks._spread import spread

CONDITIONS = ("none", "shm", "inband")
TRAIN_TOKEN, READ_TOKEN = "bench-readers-train", "bench-readers-read"
JOB = "readers"
CALL_TIMEOUT_S = 300.0
log = logger("readers")


# ================================================================================ children
def trainer_main(a: argparse.Namespace) -> None:
    """Registers and sets the buffers, says READY, steps on GO, answers RESULT."""
    import numpy as np

    from paramshard.client import ClusterSpec, ShardClient, StepArgs

    child_guard(a.lifetime)
    client = ShardClient(ClusterSpec([a.server], token=TRAIN_TOKEN), timeout_s=CALL_TIMEOUT_S)
    names = [f"b{i}" for i in range(a.buffers)]
    hyper = {"lr": 1e-3}
    try:
        for i, name in enumerate(names):
            client.register_buffer(JOB, name, a.numel, optimizer="adam", hyper=hyper)
            client.set_params(JOB, name, np.full(a.numel, i, np.float32))
        grad = np.ones(a.numel, np.float32)
        emit("READY", "")
        read_line("GO", a.lifetime)
        steps = []
        for s in range(a.steps):
            t0 = time.perf_counter()
            for name in names:
                client.push_grads(JOB, name, grad, step=s)
            t1 = time.perf_counter()
            client.step(JOB, s, {name: StepArgs(hyper) for name in names})
            t2 = time.perf_counter()
            for name in names:
                got = client.pull_params(JOB, name, a.numel, s + 1)
                if got.size != a.numel:
                    raise RuntimeError(f"{name}: pulled {got.size} of {a.numel} elements")
            t3 = time.perf_counter()
            steps.append({"s": t3 - t0, "push": t1 - t0, "step": t2 - t1, "pull": t3 - t2})
        emit("RESULT", steps)
        wait_parent_eof()
    finally:
        client.close()


def readers_main(a: argparse.Namespace) -> None:
    """``--readers`` threads pulling with the read token until STOP; answers RESULT."""
    from paramshard.client import ClusterSpec, ShardClient

    child_guard(a.lifetime)
    stop = threading.Event()
    counts = [0] * a.readers
    errors: list[str] = []
    clients = [
        ShardClient(ClusterSpec([a.server], token=READ_TOKEN), run_id=f"reader-{i}",
                    timeout_s=CALL_TIMEOUT_S)
        for i in range(a.readers)
    ]  # fmt: skip

    def pull(i: int) -> None:
        k = i
        try:
            while not stop.is_set():
                clients[i].pull_params(JOB, f"b{k % a.buffers}", a.numel, 0)
                counts[i] += 1
                k += 1
        except Exception as exc:  # noqa: BLE001 - reported in RESULT, the parent fails on it
            errors.append(f"reader {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=pull, args=(i,), daemon=True) for i in range(a.readers)]
    try:
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        emit("RUNNING", "")
        read_line("STOP", a.lifetime)
        stop.set()
        for t in threads:
            t.join(CALL_TIMEOUT_S)
        wall = time.perf_counter() - t0
        emit("RESULT", {"pulls": sum(counts), "wall_s": wall, "errors": errors[:5]})
        wait_parent_eof()
    finally:
        stop.set()
        for c in clients:
            c.close()


CHILDREN = {"_trainer": trainer_main, "_readers": readers_main}


# ================================================================================ parent
def trial(condition: str, a: argparse.Namespace, token_file: str) -> dict[str, Any]:
    """One condition on a fresh server."""
    servers, (address,) = serve_processes(1, 120.0, ["--token-file", token_file])
    kids: list[Child] = list(servers)
    try:
        argv = ["--server", address, "--buffers", str(a.buffers), "--numel", str(a.numel)]
        argv += ["--steps", str(a.steps), "--readers", str(a.readers)]
        trainer = Child.module("trainer", "benchmarks.readers", ["_trainer", *argv],
                               child_env(tuned=False), a.lifetime)  # fmt: skip
        kids.append(trainer)
        trainer.expect("READY", a.lifetime, watch=kids)
        readers = None
        if condition != "none":
            env = child_env(tuned=False)
            env["PARAMSHARD_SHM"] = "1" if condition == "shm" else "0"
            readers = Child.module("readers", "benchmarks.readers", ["_readers", *argv], env,
                                   a.lifetime)  # fmt: skip
            kids.append(readers)
            readers.expect("RUNNING", a.lifetime, watch=kids)
            time.sleep(1.0)  # the readers' first pulls are in flight before the first step
        pids = {"server": servers[0].proc.pid, "trainer": trainer.proc.pid}
        if readers is not None:
            pids["readers"] = readers.proc.pid
        cpu0 = {k: proc_cpu_s(p) for k, p in pids.items()}
        trainer.send("GO")
        steps = json.loads(trainer.expect("RESULT", a.lifetime, watch=kids))
        cpu = {k: proc_cpu_s(p) - cpu0[k] for k, p in pids.items()}
        out: dict[str, Any] = {"condition": condition}
        kept = steps[a.warmup :]
        for key in ("s", "push", "step", "pull"):
            out[f"{key}_median"] = statistics.median(x[key] for x in kept)
        out["steps_s"] = [round(x["s"], 3) for x in steps]
        out["cpu_s_per_step"] = {k: v / len(steps) for k, v in cpu.items()}
        if readers is not None:
            readers.send("STOP")
            got = json.loads(readers.expect("RESULT", CALL_TIMEOUT_S, watch=kids))
            if got["errors"]:
                raise RuntimeError(f"readers failed: {got['errors']}")
            out["reader_pulls_per_s"] = got["pulls"] / got["wall_s"]
            out["reader_gb_per_s"] = got["pulls"] * a.numel * 4 / got["wall_s"] / 1e9
        return out
    finally:
        stop_all(kids)


def repetition(rep: int, a: argparse.Namespace, token_file: str) -> dict[str, Any]:
    order = CONDITIONS[rep % 3 :] + CONDITIONS[: rep % 3]
    got = {}
    for condition in order:
        if a.wait_quiet:
            wait_quiet(a.wait_quiet, busy=lambda s: log(f"not quiet: others use {s:.0%}"))
        got[condition] = trial(condition, a, token_file)
        log(f"rep {rep} {condition}: median step {got[condition]['s_median']:.3f} s")
    return {"order": list(order), "trials": got}


def summary(reps: list[dict[str, Any]]) -> dict[str, Any]:
    cells: dict[str, Any] = {}
    for c in CONDITIONS:
        trials = [r["trials"][c] for r in reps]
        cell = {
            k: spread([t[f"{k}_median"] for t in trials]) for k in ("s", "push", "step", "pull")
        }
        cell["ratio_to_none"] = spread(
            [r["trials"][c]["s_median"] / r["trials"]["none"]["s_median"] for r in reps], 2
        )
        for who in trials[0]["cpu_s_per_step"]:
            cell[f"cpu_s_per_step_{who}"] = spread([t["cpu_s_per_step"][who] for t in trials])
        if c != "none":
            cell["reader_gb_per_s"] = spread([t["reader_gb_per_s"] for t in trials], 2)
        cells[c] = cell
    return cells


def parent_main(a: argparse.Namespace) -> int:
    install_cleanup()
    if a.quick:
        a.buffers, a.numel, a.readers, a.steps, a.warmup, a.reps = 4, 100_000, 2, 5, 2, 1
    if a.warmup >= a.steps or min(a.reps, a.buffers, a.numel, a.readers) < 1:
        raise SystemExit("--steps must exceed --warmup; --reps, --buffers, --numel, --readers >= 1")
    out: dict[str, Any] = {"benchmark": "readers", "command": " ".join(sys.argv)}
    out["machine"] = machine()
    out["machine"]["loadavg_at_start"] = loadavg()
    out["setup"] = {
        "buffers": a.buffers, "numel": a.numel, "mb_per_step_each_way": a.buffers * a.numel * 4e-6,
        "readers": a.readers, "steps": a.steps, "warmup": a.warmup, "optimizer": "adam",
    }  # fmt: skip
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="paramshard-readers-") as work:
        token_file = str(Path(work) / "tokens")
        Path(token_file).write_text(f"train {TRAIN_TOKEN}\nread {READ_TOKEN}\n")
        Path(token_file).chmod(0o600)
        out["reps"] = reps = [repetition(rep, a, token_file) for rep in range(a.reps)]
    out["cells"] = summary(reps)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    write_report(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--buffers", type=int, default=12, help="Adam buffers the trainer steps")
    p.add_argument("--numel", type=int, default=6_000_000, help="float32 elements a buffer")
    p.add_argument("--readers", type=int, default=8, help="reader threads beside the trainer")
    p.add_argument("--steps", type=int, default=12, help="trainer steps a trial")
    p.add_argument("--lifetime", type=float, default=1800.0, help="a child's longest life (s)")
    if argv and argv[0] in CHILDREN:
        p.add_argument("--server", required=True)
        args = p.parse_args(argv[1:])
        run_child(lambda: CHILDREN[argv[0]](args))
    p.add_argument("--quick", action="store_true", help="4 small buffers, 2 readers, 1 rep")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every condition")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--wait-quiet", type=float, default=0.0, help="s to wait for quiet CPUs")
    return parent_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
