"""Running ``paramshard launch`` from tests, as a user would: the launcher as a process of its
own, its environment without what it must set itself, and the waits for what it started to
go. Shared by the launch tests (tests/test_launch*.py and the ones that launch scripts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from paramshard.server import MALLOC_ENV

__all__ = [
    "ROOT", "RUN_S", "launch", "launch_env", "launch_nodes", "start_launch", "rank_envs",
    "server_pids", "is_running", "wait_gone",
]  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]
RUN_S = 90.0  # one launcher run: 2 servers + 2 ranks importing grpc and numpy on a busy machine


def launch_env(**extra: str) -> dict[str, str]:
    """The test's environment without MALLOC_*, PARAMSHARD_* and OMP_NUM_THREADS (launch must
    set them)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in MALLOC_ENV
        and not k.startswith("PARAMSHARD_")
        and k not in ("RANK", "OMP_NUM_THREADS")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def launch(
    *args: str | Path, timeout: float = RUN_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "paramshard", "launch", *map(str, args)],
        cwd=ROOT,
        env=env or launch_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def launch_script(
    folder: Path, text: str, *args: str, nproc: int = 2, timeout: float = RUN_S
) -> subprocess.CompletedProcess:
    """``text`` written to ``folder``/script.py and run by ``launch --nproc nproc`` with
    ``args`` after it."""
    script = folder / "script.py"
    script.write_text(text)
    return launch("--nproc", str(nproc), "--grace", "1", script, *args, timeout=timeout)


def rank_envs(stdout: str) -> dict[int, dict]:
    envs = [json.loads(m) for m in re.findall(r"^\[rank \d+\] ENV (.*)$", stdout, re.M)]
    return {int(e["RANK"]): e for e in envs}


def server_pids(stderr: str) -> list[int]:
    return [
        int(p) for p in re.findall(r"^\[server \d+\] .*listening on .* pid (\d+)\)$", stderr, re.M)
    ]


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # reaped between the signal and the read (seen in CI): gone too
        state = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in state  # a zombie is gone


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(map(is_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if is_running(p)]


def start_launch(*args: str | Path, stderr: int = subprocess.PIPE) -> subprocess.Popen:
    """``paramshard launch ARGS`` in the background, its output piped (``stderr``:
    ``subprocess.STDOUT`` to have both in one stream)."""
    return subprocess.Popen(
        [sys.executable, "-m", "paramshard", "launch", *map(str, args)],
        cwd=ROOT,
        env=launch_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def launch_nodes(*args: str | Path, timeout: float = RUN_S) -> list[tuple[int, str, str]]:
    """Two launchers at once, as two hosts' (``--nnodes 2 --nproc 1``, ``--node-rank`` 0 and
    1), with ``args`` after those; each one's exit code, stdout and stderr."""
    procs = [
        start_launch("--nnodes", "2", "--nproc", "1", "--node-rank", str(node), *args)
        for node in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]
