"""How ``paramshard launch`` starts its ranks and servers (paramshard/processes.py ``spawn``):
without forking the launcher, and so that none outlives it.

A ``preexec_fn`` made ``subprocess`` fork the launcher, whose gRPC threads (its checks of
``--servers``) may hold locks that gRPC's fork handlers take in the child: a field check saw a
rank that never started (the child waited in ``__run_postfork_handlers``) and ranks killed by
grpc's ``epoll_wait`` error before their exec (exit 134), 1-2 launches in 40 under load.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from paramshard.processes import spawn, stop

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")


def test_spawn_runs_no_fork_handler_of_the_launcher(tmp_path: Path) -> None:
    """A handler registered for forks (as gRPC's are) does not run for a spawned child."""
    marks = tmp_path / "marks"
    code = textwrap.dedent(f"""
        import os
        from paramshard.processes import spawn
        os.register_at_fork(after_in_child=lambda: open({str(marks)!r}, "a").write("forked\\n"))
        child = spawn("rank 0", ["echo", "started"], {{"PATH": os.environ["PATH"]}})
        out, _ = child.proc.communicate(timeout=30)
        print(out.decode().strip(), child.proc.returncode)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "started 0"
    assert not marks.exists(), "the child ran the launcher's fork handlers: it was forked"


def test_a_child_gets_sigterm_when_the_launcher_is_killed(tmp_path: Path) -> None:
    """SIGKILL of the launcher: its child (its own session, so no group signal reaches it) ends
    by the parent-death signal, SIGTERM."""
    pid_file = tmp_path / "pid"
    code = textwrap.dedent(f"""
        import os, time
        from paramshard.processes import spawn
        child = spawn("rank 0", ["sleep", "120"], {{"PATH": os.environ["PATH"]}})
        open({str(pid_file)!r}, "w").write(str(child.proc.pid))
        time.sleep(120)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        for _ in range(200):  # the child is sleep once it exec'd (after its prctl)
            if Path(f"/proc/{child}/comm").read_text().strip() == "sleep":
                break
            time.sleep(0.05)
        launcher.kill()
        launcher.wait(30)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
            state = Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0]
            if state == "Z":  # ended, not yet reaped by its new parent
                break
            time.sleep(0.05)
        else:
            gone = not Path(f"/proc/{child}").exists()
            assert gone, "the child outlived its killed launcher by 10 s"
    finally:
        launcher.kill()
        launcher.wait(30)
        if pid_file.exists() and pid_file.read_text():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_spawned_command_keeps_its_arguments_and_environment(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text("import os, sys; print(sys.argv[1:], os.environ['ONLY_HERE'])\n")
    env = {"PATH": os.environ["PATH"], "ONLY_HERE": "yes"}
    child = spawn("rank 0", [sys.executable, str(script), "a b", "--c"], env)
    out, err = child.proc.communicate(timeout=30)
    assert child.proc.returncode == 0, err
    assert out.decode().strip() == "['a b', '--c'] yes"


def test_a_stopped_child_ends_by_sigterm_without_waiting_out_the_grace() -> None:
    """``stop``: a child stopped by SIGSTOP (a debugger, an operator's ``kill -STOP``) takes
    the SIGTERM once it runs, so SIGCONT follows it; before, the launcher waited out its
    ``--grace`` (10 s) and SIGKILLed the child (seen in a field check: exit 10 s late)."""
    child = spawn("rank 0", ["sleep", "120"], {"PATH": os.environ["PATH"]})
    try:
        child.signal(signal.SIGSTOP)
        began = time.monotonic()
        stop([child], signal.SIGTERM, 30.0, [])
        took = time.monotonic() - began
        assert child.proc.returncode == -signal.SIGTERM
        assert took < 15.0, f"stop took {took:.1f} s: the stopped child waited out the grace"
    finally:
        child.signal(signal.SIGKILL)
        child.proc.wait(30)
