"""What the state surfaces cost at GPT-2 124M: replicas, snapshot, export and restore.

    python -m benchmarks.surfaces [--quick] [--reps 2] [--steps 10] [--warmup 2]
                                  [--restore-servers 4] [--dir DIR] [--wait-quiet S]

FSDP with W = 2 rank processes against 2 separate ``paramshard serve`` processes sharing one
``--snapshot-dir``; the HF GPT-2 124M of ``benchmarks/_scale_models.py`` (built from
``GPT2Config``, dropout off, 2 sequences of 128 tokens a rank), one intra-op thread a rank,
AdamW, trained through ``train_with_recovery`` (``checkpoint_every=0``). Each repetition
(``--reps``, the order of the two training conditions alternating from one to the next):

1. **replicas**: ``--steps`` steps without replicas and with ``replicate_every=1``, each on
   fresh servers. Per run the median step time after ``--warmup`` steps (a step: the slowest
   rank's forward, backward and optimizer step), and each server's peak resident memory
   (VmHWM) against the state formula (master parameters, two Adam moments and the gradient
   of its slice: 16Ψ/W bytes, plus the server's resident memory before the ranks came) and
   with replicas against without. Reference: the run without replicas of the same
   repetition (``ratio`` = with / without).
2. **snapshot** of the job trained without replicas (``paramshard snapshot``): seconds, each
   server's resident memory rise while it ran. Reference: ``torch.save`` of the same
   model's state dict and an AdamW state of the same shapes, from one process, to the same
   disk, fsynced as the shards are.
3. **export**: the snapshot offline (``paramshard export --snapshot``) and the job live from
   its servers (``paramshard export JOB``): seconds, the exporting process's peak resident
   memory and its rise; whether both files hold the same tensors. Reference:
   ``safetensors.torch.save_file`` of the model's state dict (seconds, and the rise).
4. **restore** of the snapshot onto ``--restore-servers`` fresh servers
   (``paramshard restore JOB --tag T --contributors 2``): seconds and each new server's peak
   resident memory against its share of the snapshot (the shards' bytes / N, plus its
   resident memory before). Reference: ``torch.load`` of the file of (2).

Every command runs in a process of its own, timed from its call to its return (no
interpreter start, on either side). Every cell reports each repetition's value, the median
and the spread (min, max), and its ratio to the reference measured in the same repetition.
MemAvailable is checked first (GPT-2 124M with replicas needs about 15 GB here).

``--quick``: the 0.1M-parameter GPT-2, 5 steps, one repetition (seconds).
JSON to stdout, progress to stderr; every child is started here and stopped by PID.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _surfaces_cells as cells
from benchmarks._cpu import wait_quiet
from benchmarks._processes import install_cleanup, logger, run_child, stop_all
from benchmarks._scale_memory import GiB, loadavg, machine, meminfo, param_count, write_report
from benchmarks._scale_models import MODELS
from benchmarks._spread import spread
from benchmarks._surfaces_children import CHILDREN, child_parser

WORLD = 2
log = logger("surfaces")


# ================================================================================ summaries
def step_s(ranks: list[dict[str, Any]], warmup: int) -> float:
    """The median, after ``warmup`` steps, of each step's slowest rank."""
    per_step = [max(r["steps"][i]["s"] for r in ranks) for i in range(len(ranks[0]["steps"]))]
    return statistics.median(per_step[warmup:])


def needed_bytes(psi: int) -> int:
    """What a repetition needs at most: W trainers (the model as built, its gradient, the
    gathered units, activations: 14Ψ is what GPT-2 124M's ranks peaked at, 1.7 GB), W
    servers with replicas (about 5.5 x their 16Ψ/W of state), 256 MiB of interpreter each."""
    return WORLD * 14 * psi + int(5.5 * 16 * psi) + 2 * WORLD * 2**28


# ================================================================================ one repetition
def repetition(rep: int, a: argparse.Namespace, psi: int) -> dict[str, Any]:
    folder = Path(a.work) / f"rep{rep}"
    snapshots, outputs = folder / "snapshots", folder / "out"
    snapshots.mkdir(parents=True)
    outputs.mkdir()
    out: dict[str, Any] = {"rep": rep, "runs": {}}
    order = (0, 1) if rep % 2 == 0 else (1, 0)  # replicate_every: alternating which goes first
    for every in order:
        name = "with" if every else "without"
        if a.wait_quiet > 0:
            out[f"busy_before_{name}"] = wait_quiet(a.wait_quiet)
        log(f"rep {rep}: training {a.steps} steps {name} replicas")
        run = cells.train(a.model, WORLD, a.steps, every, a.step_budget, str(snapshots))
        try:
            out["runs"][name] = summary = _run_summary(run, a, psi)
            log(
                f"  step {summary['step_s']:.3f} s, servers peak {summary['server_peak_rss_mb']}"
                f" MB ({summary['server_peak_vs_formula']}x the formula)"
            )
            if not every:
                out.update(_surfaces(run, a, snapshots, outputs))
        finally:
            stop_all(run["servers"])
    log(f"rep {rep}: reference (torch.save, torch.load, save_file)")
    out["reference"] = cells.reference(a.model, str(outputs))
    shutil.rmtree(folder, ignore_errors=True)
    return out


def _run_summary(run: dict[str, Any], a: argparse.Namespace, psi: int) -> dict[str, Any]:
    idle = run["server_idle_rss_bytes"]
    formula = [16 * psi / WORLD + i for i in idle]
    peaks = run["server_peak_rss_bytes"]
    r0 = run["ranks"][0]
    out = {
        "step_s": round(step_s(run["ranks"], a.warmup), 3),
        "steps_s": [round(max(r["steps"][i]["s"] for r in run["ranks"]), 3)
                    for i in range(len(r0["steps"]))],
        "wall_s": run["wall_s"],
        "loadavg_at_start": run["loadavg_at_start"],
        "foreign_cpu_frac": run["foreign_cpu_frac"],
        "losses": r0["losses"],
        "recoveries": max(r["recoveries"] for r in run["ranks"]),
        "trainer_peak_rss_mb": [round(r["peak_rss_bytes"] / 2**20) for r in run["ranks"]],
        "server_idle_rss_mb": [round(i / 2**20) for i in idle],
        "server_peak_rss_mb": [round(p / 2**20) for p in peaks],
        "server_peak_own_mb": [round(p / 2**20) for p in run["server_peak_anon_bytes"]],
        "server_peak_shmem_mb": [round(p / 2**20) for p in run["server_peak_shmem_bytes"]],
        "server_formula_mb": [round(f / 2**20) for f in formula],
        "server_peak_vs_formula": round(max(p / f for p, f in zip(peaks, formula, strict=True)), 2),
        "replicas": r0.get("replicas"),
    }  # fmt: skip
    return out


def _surfaces(run: dict[str, Any], a: argparse.Namespace, snapshots: Path, outputs: Path) -> dict:
    """Snapshot, exports and restore of the job a run trained, its servers still up."""
    job, tag = run["job"], "bench"
    log(f"  snapshot of {job}")
    res: dict[str, Any] = {}
    res["snapshot"] = cells.snapshot(job, tag, run["servers"], run["addresses"], str(snapshots))
    log(f"    {res['snapshot']['wall_s']} s; exports")
    res["export"] = cells.exports(job, tag, run["addresses"], str(snapshots), str(outputs))
    ex = res["export"]
    log(f"    offline {ex['offline']['wall_s']} s, live {ex['live']['wall_s']} s; restore")
    res["restore"] = got = cells.restore(job, tag, a.restore_servers, WORLD, str(snapshots))
    share = res["snapshot"]["shard_bytes"] / a.restore_servers / 2**20  # MiB
    got["share_mb"] = round(share, 1)
    pairs = zip(got["server_peak_rss_mb"], got["server_idle_rss_mb"], strict=True)
    got["server_peak_vs_share"] = round(max(p / (share + i) for p, i in pairs), 2)
    log(f"    {got['wall_s']} s onto {a.restore_servers} servers")
    return res


# ================================================================================ the cells
def cells_summary(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Every cell over the repetitions: values, median, spread, ratio to its reference."""

    def each(fn: Any) -> list[float]:
        return [fn(r) for r in reps]

    with_, without = (lambda r: r["runs"]["with"]), (lambda r: r["runs"]["without"])
    out: dict[str, Any] = {}
    out["replicas"] = {
        "step_s_without": spread(each(lambda r: without(r)["step_s"])),
        "step_s_with": spread(each(lambda r: with_(r)["step_s"])),
        "ratio_with_to_without": spread(
            each(lambda r: with_(r)["step_s"] / without(r)["step_s"]), 2
        ),
        "server_peak_mb_without": spread(each(lambda r: max(without(r)["server_peak_rss_mb"])), 0),
        "server_peak_mb_with": spread(each(lambda r: max(with_(r)["server_peak_rss_mb"])), 0),
        "server_formula_mb": spread(each(lambda r: max(without(r)["server_formula_mb"])), 0),
        "server_peak_vs_formula_without": spread(
            each(lambda r: without(r)["server_peak_vs_formula"]), 2
        ),
        "server_peak_vs_formula_with": spread(
            each(lambda r: with_(r)["server_peak_vs_formula"]), 2
        ),
        "server_peak_with_to_without": spread(
            each(
                lambda r: (
                    max(with_(r)["server_peak_rss_mb"]) / max(without(r)["server_peak_rss_mb"])
                )
            ),
            2,
        ),
    }
    ref = lambda key: lambda r: r["reference"][key]["wall_s"]  # noqa: E731
    out["snapshot"] = {
        "wall_s": spread(each(lambda r: r["snapshot"]["wall_s"])),
        "server_rss_rise_mb": spread(each(lambda r: max(r["snapshot"]["server_rss_rise_mb"])), 1),
        "reference_torch_save_s": spread(each(ref("torch_save"))),
        "ratio_to_torch_save": spread(
            each(lambda r: r["snapshot"]["wall_s"] / r["reference"]["torch_save"]["wall_s"]), 2
        ),
    }
    save_file_rise = lambda r: r["reference"]["save_file"]["rss_rise_mb"]  # noqa: E731
    out["export"] = {"reference_save_file_s": spread(each(ref("save_file")))}
    out["export"]["reference_save_file_rss_rise_mb"] = spread(each(save_file_rise), 1)
    for kind in ("offline", "live"):
        got = lambda r, k=kind: r["export"][k]  # noqa: E731
        out["export"][kind] = {
            "wall_s": spread(each(lambda r, g=got: g(r)["wall_s"])),
            "peak_rss_mb": spread(each(lambda r, g=got: g(r)["peak_rss_mb"]), 1),
            "rss_rise_mb": spread(each(lambda r, g=got: g(r)["rss_rise_mb"]), 1),
            "ratio_to_save_file_s": spread(
                each(lambda r, g=got: g(r)["wall_s"] / r["reference"]["save_file"]["wall_s"]), 2
            ),
            # save_file writes from the model's own tensors (its rise is about 0): an export's
            # rise is put against the largest tensor, which streaming holds at least
            "rss_rise_to_largest_tensor": spread(
                each(lambda r, g=got: g(r)["rss_rise_mb"] / r["export"]["largest_tensor_mb"]), 2
            ),
        }
    out["export"]["same_tensors_offline_and_live"] = all(r["export"]["same_tensors"] for r in reps)
    out["restore"] = {
        "wall_s": spread(each(lambda r: r["restore"]["wall_s"])),
        "server_peak_mb": spread(each(lambda r: max(r["restore"]["server_peak_rss_mb"])), 1),
        "share_mb": spread(each(lambda r: r["restore"]["share_mb"]), 1),
        "server_peak_vs_share": spread(each(lambda r: r["restore"]["server_peak_vs_share"]), 2),
        "reference_torch_load_s": spread(each(ref("torch_load"))),
        "ratio_to_torch_load": spread(
            each(lambda r: r["restore"]["wall_s"] / r["reference"]["torch_load"]["wall_s"]), 2
        ),
    }
    return out


# ================================================================================ main
def parent_main(a: argparse.Namespace) -> int:
    install_cleanup()
    if a.quick:
        a.model, a.steps, a.warmup, a.reps = "quick", 5, 2, 1
    if a.warmup >= a.steps:
        raise SystemExit(f"--steps ({a.steps}) must exceed --warmup ({a.warmup})")
    if a.reps < 1 or a.restore_servers < 1:
        raise SystemExit("--reps and --restore-servers must be at least 1")
    psi = param_count(a.model)
    need, avail = needed_bytes(psi), meminfo("MemAvailable")
    if need + a.margin_gib * GiB > avail:
        raise SystemExit(
            f"needs about {need / GiB:.1f} GiB and a {a.margin_gib:g} GiB margin;"
            f" MemAvailable is {avail / GiB:.1f} GiB"
        )
    out: dict[str, Any] = {"benchmark": "surfaces", "command": " ".join(sys.argv)}
    out["machine"] = machine()
    out["machine"]["loadavg_at_start"] = loadavg()
    out["machine"]["mem_available_gib_at_start"] = round(avail / GiB, 1)
    spec = MODELS[a.model]
    out["model"] = {
        "name": a.model, "n_params": psi, "config": spec.config, "seq_len": spec.seq_len,
        "batch_per_rank": spec.batch_per_rank, "steps": a.steps, "warmup": a.warmup,
    }  # fmt: skip
    out["setup"] = {"strategy": "fsdp", "world_size": WORLD, "restore_servers": a.restore_servers}
    out["setup"]["estimate_gib"] = round(need / GiB, 1)
    t0 = time.monotonic()
    a.work = tempfile.mkdtemp(prefix="paramshard-surfaces-", dir=a.dir or None)
    try:
        out["reps"] = reps = [repetition(rep, a, psi) for rep in range(a.reps)]
    finally:
        shutil.rmtree(a.work, ignore_errors=True)
    out["cells"] = cells_summary(reps)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    write_report(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in CHILDREN:
        args = child_parser().parse_args(argv[1:])
        run_child(lambda: CHILDREN[argv[0]](args))
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="0.1M-parameter GPT-2, 5 steps, 1 rep")
    p.add_argument("--model", default="gpt2-124m", choices=sorted(MODELS))
    p.add_argument("--reps", type=int, default=2, help="repetitions of every cell")
    p.add_argument("--steps", type=int, default=10, help="training steps a run")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--restore-servers", type=int, default=4, help="servers restored onto")
    p.add_argument("--dir", default="", help="where snapshots and files go (default: a temp dir)")
    p.add_argument("--wait-quiet", type=float, default=0.0, help="s to wait for quiet CPUs")
    p.add_argument("--margin-gib", type=float, default=1.0, help="memory left free (GiB)")
    p.add_argument("--step-budget", type=float, default=120.0, help="seconds a step may take")
    return parent_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
