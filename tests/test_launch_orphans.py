"""``paramshard launch`` stops the whole process group of a rank that failed, promptly.

Each rank starts a background ``sleep`` (as a data loader worker or a shell pipeline would) and
writes its pid to a file; rank 0 then exits with code 4. The launcher must report the failure
at once, although the ``sleep`` keeps the rank's stdout and stderr pipes open, and stop every
rank's group: the dead rank's ``sleep`` (its group leader is gone) as well as the living ones.

Measured on the development machine, from rank 0's exit to the launcher's exit: before the fix
about 20.5 s with ``--nproc 1`` (the exit was reported only after the pipes were waited on for
2 x 5 s, and again 2 x 5 s while stopping) and 20.3 s with ``--nproc 2``, the dead rank's
``sleep`` left running in both; after it, 0.4 s and 0.5 s, nothing left. ``EXIT_LAG_S`` sits
between the two, with room for a busy machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_launch import launch_env, wait_gone  # noqa: E402

pytestmark = pytest.mark.timeout(180)

RUN_S = 90.0  # one launcher run, servers included, on a busy machine
EXIT_LAG_S = 6.0  # rank 0's exit to the launcher's: ~0.5 s now, ~20 s before the fix

LEAVES_A_CHILD = r"""
import os, subprocess, sys, time
from pathlib import Path

rank, world, folder = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), Path(sys.argv[1])
child = subprocess.Popen(["sleep", "40"])  # inherits the rank's stdout and stderr
(folder / f"child.{rank}").write_text(str(child.pid))
if rank != 0:
    time.sleep(60)  # until the launcher stops it
deadline = time.monotonic() + 30
while len(list(folder.glob("child.*"))) < world and time.monotonic() < deadline:
    time.sleep(0.05)
print("failing now", flush=True)
(folder / "failed_at").write_text(repr(time.time()))
sys.exit(4)
"""


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_failed_ranks_background_child_is_stopped_promptly(tmp_path: Path, nproc: int) -> None:
    script = tmp_path / "leaves_a_child.py"
    script.write_text(LEAVES_A_CHILD)
    folder = tmp_path / "pids"
    folder.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "paramshard", "launch", "--nproc", str(nproc), str(script)]
        + [str(folder)],
        cwd=ROOT,
        env=launch_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the test can clean up whatever the launcher leaves
    )
    try:
        out, err = proc.communicate(timeout=RUN_S)
        ended_at = time.time()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=10)
    children = [int(p.read_text()) for p in sorted(folder.glob("child.*"))]
    try:
        assert proc.returncode == 4, out + err
        assert "[rank 0] failing now" in out
        assert "rank 0 failed with exit code 4" in err
        lag = ended_at - float((folder / "failed_at").read_text())
        assert lag < EXIT_LAG_S, f"the launcher exited {lag:.1f} s after rank 0 failed\n{err}"
        assert len(children) == nproc
        assert wait_gone(children, timeout=2.0) == [], f"left running: {children}\n{err}"
    finally:
        for pid in children:  # never leave a sleep behind, whatever failed
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
