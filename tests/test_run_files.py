"""Issue 26, requirement 5: the job tools find a job ``paramshard launch`` started.

- The launcher keeps a run file (servers, run id, job name, token file, snapshot folder) in
  the per-user run directory (0700, the file 0600) while it runs, and removes it on every
  exit path: the ranks succeed, a rank fails, SIGINT, SIGTERM. A launcher killed outright
  leaves it; the tools then ignore it and remove it.
- ``cluster_spec`` (every client command): ``--servers``, else ``PARAMSHARD_SERVERS``, else
  the one live run; several are listed and ``--run`` picks one; its token comes from the run's
  token file (the admin token for the tools, which snapshot and restore).
- A snapshot retried at a later version (training stepped past the first) replaces the shard
  its first attempt left.

Launches are real processes (servers and ranks); the runs' directory is the test's own
(``PARAMSHARD_RUN_DIR``).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from paramshard import cli, commands, run_files
from paramshard.client import ClusterSpec, ShardClient
from paramshard.protos import shard_pb2 as pb
from paramshard.server import MALLOC_ENV, ShardServer

ROOT = Path(__file__).resolve().parents[1]
RUN_S = 90.0  # one launch: a server and a rank starting on a busy machine
pytestmark = pytest.mark.timeout(300)

RANK = r"""
import json, os, resource, sys, time
from pathlib import Path

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a forwarded SIGQUIT leaves no core file
here = Path(sys.argv[1])
(here / "env.json").write_text(json.dumps({k: v for k, v in os.environ.items()
                                           if k.startswith("PARAMSHARD_")}))
deadline = time.monotonic() + 60
while not (here / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(int((here / "go").read_text() or 0) if (here / "go").exists() else 9)
"""


def env(run_dir: Path, **extra: str) -> dict[str, str]:
    """The test's environment: no PARAMSHARD_* or MALLOC_* of its own, this test's run dir."""
    out = {
        k: v
        for k, v in os.environ.items()
        if k not in MALLOC_ENV and not k.startswith("PARAMSHARD_") and k != "RANK"
    }
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), out.get("PYTHONPATH")]))
    out[run_files.RUN_DIR_ENV] = str(run_dir)
    out.update(extra)
    return out


def wait_for(path: Path, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + RUN_S
    while not path.exists():
        assert proc.poll() is None, f"launch exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def start_launch(tmp_path: Path, *extra: str) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return subprocess.Popen(
        [sys.executable, "-m", "paramshard", "launch", "--nproc", "1", *extra, str(script),
         str(tmp_path)],
        cwd=ROOT,
        env=env(tmp_path / "runs"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


@pytest.mark.parametrize("ending", ["ok", "rank fails", "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"])
def test_launch_keeps_a_run_file_while_it_runs(tmp_path: Path, ending: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"job": "gpt"}))
    token = tmp_path / "token"
    token.write_text("train sekrit\nadmin boss\n")
    proc = start_launch(tmp_path, "--config", str(config), "--token-file", str(token))
    try:
        wait_for(tmp_path / "env.json", proc, "the rank to start")
        rank_env = json.loads((tmp_path / "env.json").read_text())
        runs = tmp_path / "runs"
        (found,) = runs.glob("*.json")
        record = json.loads(found.read_text())
        assert stat.S_IMODE(runs.stat().st_mode) == 0o700
        assert stat.S_IMODE(found.stat().st_mode) == 0o600
        assert record["run_id"] == rank_env["PARAMSHARD_RUN"]
        assert record["servers"] == rank_env["PARAMSHARD_SERVERS"].split(",")
        assert record["jobs"] == ["gpt"] and record["token_file"] == str(token)
        snapshots = Path(record["snapshot_dir"])
        assert snapshots == runs / record["run_id"] / "snapshots" and snapshots.is_dir()
        assert stat.S_IMODE(snapshots.parent.stat().st_mode) == 0o700
        if ending in ("ok", "rank fails"):
            (tmp_path / "go").write_text("0" if ending == "ok" else "3")
            expected = 0 if ending == "ok" else 3
        else:
            signum = signal.Signals[ending]
            proc.send_signal(signum)
            expected = 128 + signum
        assert proc.wait(timeout=60) == expected, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
    assert list(runs.iterdir()) == [], "the run file (and the unused snapshot folder) stay"


def test_a_killed_launchers_run_file_is_ignored_and_removed(tmp_path: Path) -> None:
    proc = start_launch(tmp_path)
    try:
        wait_for(tmp_path / "env.json", proc, "the rank to start")
        proc.kill()  # no clean-up: its run file stays behind
        proc.wait(10)
    finally:
        (tmp_path / "go").write_text("0")  # the orphaned rank and server end on their own
        proc.stdout.close()
        proc.stderr.close()
    runs = tmp_path / "runs"
    assert len(list(runs.glob("*.json"))) == 1
    out = subprocess.run(
        [sys.executable, "-m", "paramshard", "status"],
        cwd=ROOT,
        env=env(runs),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and "no run started by paramshard launch is alive" in out.stderr
    assert list(runs.glob("*.json")) == []


# ------------------------------------------------------------------------- finding the servers
@pytest.fixture
def two_servers() -> list[ShardServer]:
    started = [ShardServer("127.0.0.1", 0).start() for _ in range(2)]
    yield started
    for s in started:
        s.stop(0)


def announce(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run_id: str, servers: list[str],
             **fields: object) -> run_files.RunFile:  # fmt: skip
    """A run file of a live launcher (this process) in the test's run dir."""
    monkeypatch.setenv(run_files.RUN_DIR_ENV, str(tmp_path / "runs"))
    run = run_files.RunFile.for_launch(run_id=run_id, servers=servers, **fields)
    run.write()
    return run


def test_status_finds_the_only_run_and_asks_among_several(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    two_servers: list[ShardServer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("PARAMSHARD_SERVERS", raising=False)
    a, b = (s.address for s in two_servers)
    announce(monkeypatch, tmp_path, "run-a", [a])
    assert cli.main(["status", "--json"]) == 0
    out = capsys.readouterr()
    assert [r["address"] for r in json.loads(out.out)] == [a]
    assert "using run run-a" in out.err
    announce(monkeypatch, tmp_path, "run-b", [b])
    assert cli.main(["status"]) == 2
    err = capsys.readouterr().err
    assert "2 runs started by paramshard launch are alive; pick one with --run" in err
    assert "run-a (servers " + a in err and "run-b (servers " + b in err
    assert cli.main(["status", "--run", "run-b", "--json"]) == 0
    assert [r["address"] for r in json.loads(capsys.readouterr().out)] == [b]
    assert cli.main(["status", "--run", "run-c"]) == 2
    assert "no live run 'run-c'" in capsys.readouterr().err
    # --servers and PARAMSHARD_SERVERS come first, as before
    assert commands.cluster_spec(b).addresses == [b]
    monkeypatch.setenv("PARAMSHARD_SERVERS", a)
    assert commands.cluster_spec(None).addresses == [a]


def test_a_dead_launchers_file_is_dropped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    run = announce(monkeypatch, tmp_path, "run-dead", ["127.0.0.1:1"])
    record = json.loads(run.path.read_text())
    run.path.write_text(json.dumps({**record, "pid": gone.pid}))
    live = announce(monkeypatch, tmp_path, "run-live", ["127.0.0.1:2"])
    assert [r.run_id for r in run_files.live_runs()] == ["run-live"]
    assert not run.path.exists() and live.path.exists()


def test_a_second_launcher_of_a_run_id_leaves_the_first_ones_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second launch under a live run's id (refused by the servers, or another node of the
    run on this host) replaced the first launcher's run file and removed it at its exit: the
    tools lost the run that still trained."""
    first = announce(monkeypatch, tmp_path, "run-twice", ["127.0.0.1:1"])
    second = run_files.announce_run("run-twice", ["127.0.0.1:2"], None, None, None)
    assert second.path is None
    assert "has a run file of another live launcher: it stays" in capsys.readouterr().err
    second.remove()
    assert first.path is not None and first.path.exists()
    assert [r.servers for r in run_files.live_runs()] == [["127.0.0.1:1"]]
    first.remove()
    assert not first.path.exists()
    # a dead launcher's file is replaced by the next launcher of the id, as before
    earlier = announce(monkeypatch, tmp_path, "run-again", ["127.0.0.1:3"])
    record = json.loads(earlier.path.read_text())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    (tmp_path / "runs" / "run-again.json").write_text(json.dumps({**record, "pid": gone.pid}))
    again = announce(monkeypatch, tmp_path, "run-again", ["127.0.0.1:4"])
    assert again.path is not None
    assert [r.servers for r in run_files.live_runs()] == [["127.0.0.1:4"]]


def test_the_runs_token_file_gives_each_tool_its_role(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server token file holds a token per role: the tools (snapshot, restore) take the
    admin one, ``status`` the read one; PARAMSHARD_TOKEN still wins, and says so (a stale
    one in a shell was refused with no word of the run's file)."""
    tokens = {"r-token": "read", "t-token": "train", "a-token": "admin"}
    token_file = tmp_path / "tokens"
    token_file.write_text("".join(f"{role} {t}\n" for t, role in tokens.items()))
    monkeypatch.delenv("PARAMSHARD_SERVERS", raising=False)
    monkeypatch.delenv("PARAMSHARD_TOKEN", raising=False)
    with ShardServer("127.0.0.1", 0, tokens=tokens) as server:
        announce(monkeypatch, tmp_path, "run-t", [server.address], token_file=str(token_file))
        assert commands.cluster_spec(None).token == "a-token"
        assert commands.cluster_spec(None, role="read").token == "r-token"
        assert cli.main(["status", "--json"]) == 0
        monkeypatch.setenv("PARAMSHARD_TOKEN", "t-token")
        capsys.readouterr()
        assert commands.cluster_spec(None).token == "t-token"
        assert f"PARAMSHARD_TOKEN's, not the run's token file {token_file}" in (
            capsys.readouterr().err
        )


def test_snapshot_dir_is_for_local_servers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["launch", "--nproc", "1", "--servers", "127.0.0.1:1", "--snapshot-dir", "/tmp/x"]
    assert cli.main([*argv, __file__]) == 2
    assert "--snapshot-dir is for the local servers" in capsys.readouterr().err


def test_a_retried_snapshot_replaces_the_shard_its_first_attempt_left(tmp_path: Path) -> None:
    """Snapshot at version v wrote server 0's shard while server 1 had stepped past v; the
    client tries v + 1 under the same tag: server 0 replaces its uncommitted shard (a shard of
    the same version stays refused: tests/test_hardening_snapshots.py)."""
    root = tmp_path / "snaps"
    with ShardServer("127.0.0.1", 0, snapshot_dir=str(root)) as server:
        c = ShardClient(ClusterSpec([server.address]), timeout_s=20.0)
        try:
            c.register_buffer("j", "w", 8, optimizer="sgd", hyper={"lr": 0.1})
            c.set_params("j", "w", np.ones(8, np.float32), version=1)

            def snapshot(version: int) -> pb.SnapshotReply:
                request = pb.SnapshotRequest(
                    job="j", tag="t", version=version, server_index=0, num_servers=1
                )
                return c.call(0, "Snapshot", request)

            first = snapshot(1)
            c.set_params("j", "w", np.full(8, 2.0, np.float32), version=2)
            second = snapshot(2)
        finally:
            c.close()
    assert (first.version, second.version) == (1, 2) and first.sha256 != second.sha256
    shard = root / "j" / "t" / "shard-0-of-1.safetensors"
    from paramshard.server.snapshots.shards import decode_shard

    meta, tensors = decode_shard(shard.read_bytes())
    assert meta["version"] == 2 and float(tensors["w::params"][0]) == 2.0


def test_launch_runs_without_a_run_directory(tmp_path: Path) -> None:
    """A run directory that cannot be made (a read-only home, here a path under a file): the
    job still runs, with a warning that the tools will not find it by themselves."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    (tmp_path / "go").write_text("0")
    out = subprocess.run(
        [sys.executable, "-m", "paramshard", "launch", "--nproc", "1", str(script),
         str(tmp_path)],
        cwd=ROOT, env=env(blocker / "runs"), capture_output=True, text=True, timeout=RUN_S,
        check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "warning: no snapshot directory for the local servers" in out.stderr
    assert "warning: no run file" in out.stderr and "need --servers" in out.stderr
