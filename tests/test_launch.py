"""``paramshard launch``: servers and ranks as real processes, the way users start them.

A tiny script prints its environment and all-reduces ``rank + 1`` through
``ShardClient.from_env()``; other modes of it fail, ignore SIGTERM or wait for Ctrl-C, to check
that the launcher stops everything and exits with the right code. Every wait is bounded.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from launching import (
    ROOT,
    RUN_S,
    launch,
    launch_env,
    launch_nodes,
    rank_envs,
    server_pids,
    start_launch,
    wait_gone,
)

from paramshard import cli
from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.run_id import run_id_from_env
from paramshard.launch import read_token
from paramshard.server import MALLOC_ENV

pytestmark = pytest.mark.timeout(240)

TINY = r"""
import json, os, signal, sys, time
from pathlib import Path

mode, rank = sys.argv[1], int(os.environ["RANK"])
names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
         "PARAMSHARD_RUN", "PARAMSHARD_SERVERS", "PARAMSHARD_TOKEN", "OMP_NUM_THREADS",
         *sorted(k for k in os.environ if k.startswith("MALLOC_"))]
print("ENV " + json.dumps({"pid": os.getpid(), "argv": sys.argv[1:],
                          **{k: os.environ.get(k) for k in names}}), flush=True)
if mode == "ok":
    import numpy as np
    from paramshard.client import ShardClient
    client = ShardClient.from_env(timeout_s=20.0)
    total = client.all_reduce(np.array([rank + 1.0], dtype=np.float32))
    client.close()
    print(f"sum {float(total[0])}")
    print(f"rank {rank} on stderr", file=sys.stderr)
elif mode == "fail":  # rank 0 ignores SIGTERM (it must be killed); rank 1 fails once it is so
    marker = Path(sys.argv[2])
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        marker.write_text("ready")
        time.sleep(60)
    else:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        print("failing now", file=sys.stderr)
        sys.exit(3)
elif mode == "wait":  # until Ctrl-C (or SIGTERM's default action)
    try:
        print("ready", flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("launch") / "tiny.py"
    path.write_text(TINY)
    return path


# ------------------------------------------------------------------------------------ success
def test_local_servers_env_prefixes_and_all_reduce(tiny: Path) -> None:
    result = launch("--nproc", "2", tiny, "ok", "--flag", "x y")
    assert result.returncode == 0, result.stdout + result.stderr

    for line in result.stdout.splitlines():  # every line a rank printed, and nothing else
        assert re.match(r"\[rank [01]\] ", line), line
    assert sorted(re.findall(r"^\[rank (\d)\] sum 3\.0$", result.stdout, re.M)) == ["0", "1"]
    assert "[rank 0] rank 0 on stderr" in result.stderr.splitlines()
    assert "[rank 1] rank 1 on stderr" in result.stderr.splitlines()

    envs = rank_envs(result.stdout)
    assert sorted(envs) == [0, 1]
    servers = envs[0]["PARAMSHARD_SERVERS"].split(",")
    assert len(servers) == 2 and all(re.fullmatch(r"127\.0\.0\.1:\d+", s) for s in servers)
    for rank, env in envs.items():
        assert env["argv"] == ["ok", "--flag", "x y"]
        assert (env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
            "2",
            str(rank),
            "2",
        )
        assert env["GROUP_RANK"] == "0"
        assert env["PARAMSHARD_SERVERS"] == envs[0]["PARAMSHARD_SERVERS"]
        assert env["PARAMSHARD_RUN"] == envs[0]["PARAMSHARD_RUN"] != ""
        assert env["PARAMSHARD_TOKEN"] is None
        # glibc's defaults, as under torchrun: the servers' settings cost a trainer memory
        assert [env.get(k) for k in MALLOC_ENV] == [None] * len(MALLOC_ENV)
        assert env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert f"OMP_NUM_THREADS={envs[0]['OMP_NUM_THREADS']} for every rank" in result.stderr

    pids = server_pids(result.stderr)
    assert len(pids) == 2, result.stderr
    assert result.stderr.count("paramshard serve: stopped") == 2, result.stderr
    assert wait_gone(pids) == []
    assert "Traceback" not in result.stderr


def test_omp_num_threads_and_malloc_settings_of_the_user_are_kept(tiny: Path) -> None:
    """OMP_NUM_THREADS in the environment wins over the launcher's share of the cores, and
    one rank gets none (torch's own default), as under torchrun. MALLOC_* settings the user
    set reach the ranks as set."""
    user = launch_env(OMP_NUM_THREADS="3", MALLOC_ARENA_MAX="2")
    result = launch("--nproc", "2", tiny, "ok", env=user)
    assert result.returncode == 0, result.stdout + result.stderr
    envs = rank_envs(result.stdout).values()
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["3", "3"]
    assert [e["MALLOC_ARENA_MAX"] for e in envs] == ["2", "2"]
    assert [e.get("MALLOC_MMAP_THRESHOLD_") for e in envs] == [None, None]
    assert "OMP_NUM_THREADS=" not in result.stderr
    result = launch("--nproc", "1", tiny, "ok")
    assert result.returncode == 0, result.stdout + result.stderr
    assert rank_envs(result.stdout)[0]["OMP_NUM_THREADS"] is None
    assert "PARAMSHARD_SERVERS is set" not in result.stderr


def test_a_shells_servers_are_not_the_launchers(tiny: Path) -> None:
    """PARAMSHARD_SERVERS in the environment (the job tools read it) is not where launch's
    ranks go without --servers: it says so, and the ranks get its own servers."""
    result = launch("--nproc", "1", tiny, "ok", env=launch_env(PARAMSHARD_SERVERS="127.0.0.1:1"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PARAMSHARD_SERVERS is set, but without --servers launch starts servers" in (
        result.stderr
    )
    assert rank_envs(result.stdout)[0]["PARAMSHARD_SERVERS"] != "127.0.0.1:1"


def test_given_servers_and_two_nodes(tiny: Path, servers, tmp_path: Path) -> None:  # noqa: ANN001
    addresses = ",".join(s.address for s in servers(2))
    token = tmp_path / "tokens"
    token.write_text("# roles\nread r-token\ntrain t-token\n")
    common = ["--servers", addresses, "--run-id", "two-nodes", "--token-file", str(token)]
    for node, (code, out, err) in enumerate(launch_nodes(*common, tiny, "ok")):
        assert code == 0, out + err
        assert f"[rank {node}] sum 3.0" in out.splitlines(), out + err
        assert "[server" not in err  # no local servers with --servers
        env = rank_envs(out)[node]
        assert (env["WORLD_SIZE"], env["LOCAL_RANK"], env["GROUP_RANK"]) == ("2", "0", str(node))
        assert env["PARAMSHARD_SERVERS"] == addresses
        assert env["PARAMSHARD_RUN"] == "two-nodes"
        assert env["PARAMSHARD_TOKEN"] == "t-token"  # the train token of a server token file


# ------------------------------------------------------------------------------------ failure
def test_failing_rank_stops_the_others_and_sets_the_exit_code(tiny: Path, tmp_path: Path) -> None:
    start = time.monotonic()
    result = launch("--nproc", "2", "--grace", "1", tiny, "fail", tmp_path / "marker")
    assert time.monotonic() - start < 60
    assert result.returncode == 3, result.stdout + result.stderr
    assert "[rank 1] failing now" in result.stderr
    assert "paramshard launch: rank 1 failed with exit code 3; stopping 1 other rank" in (
        result.stderr
    )
    assert "rank 0 (pid" in result.stderr and "killing it" in result.stderr  # ignored SIGTERM
    rank0 = rank_envs(result.stdout)[0]["pid"]
    assert wait_gone([rank0, *server_pids(result.stderr)]) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_is_forwarded_to_the_ranks(tiny: Path, signum: int) -> None:
    proc = start_launch("--nproc", "2", tiny, "wait")
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
    reader.start()
    try:
        ready: set[str] = set()
        out: list[str] = []
        deadline = time.monotonic() + RUN_S
        while len(ready) < 2:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            out.append(line)
            if line.rstrip().endswith("] ready"):
                ready.add(line.split("]")[0])
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == 128 + signum
        reader.join(10)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    while not lines.empty():
        out.append(lines.get_nowait())
    stdout = "".join(out)
    if signum == signal.SIGINT:  # Python turns a forwarded SIGINT into KeyboardInterrupt
        assert sorted(re.findall(r"^\[rank (\d)\] interrupted$", stdout, re.M)) == ["0", "1"]
    assert f"{signal.Signals(signum).name}: stopping the ranks" in err
    pids = [e["pid"] for e in rank_envs(stdout).values()] + server_pids(err)
    assert len(pids) == 4, stdout + err
    assert wait_gone(pids) == []


@pytest.mark.skipif(
    importlib.util.find_spec("cupy") is not None,
    reason="CuPy is installed: a CUDA server might start",
)
def test_server_that_cannot_start_is_reported(tiny: Path) -> None:
    result = launch("--nproc", "1", "--device", "cuda", tiny, "ok", timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "paramshard launch: error: server 0 exited while starting (exit code 2)" in (
        result.stderr
    )
    assert "[server 0] paramshard serve: error: device 'cuda:0'" in result.stderr
    assert "[rank" not in result.stdout


def test_unreachable_servers_time_out(tiny: Path) -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    result = launch("--nproc", "1", "--servers", dead, "--start-timeout", "1", tiny, "ok")
    assert result.returncode == 1
    assert f"server {dead} is not serving after 1 s" in result.stderr
    assert "[rank" not in result.stdout


# ---------------------------------------------------------------------------- usage, in-process
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "1", "no/such/script.py"], "no such script: no/such/script.py"),
        (["--nproc", "1", "--nnodes", "2", "x.py"], "--nnodes > 1 needs --servers"),
        (["--nproc", "1", "--nnodes", "2", "--servers", "h:1", "x.py"], "needs --run-id"),
        (["--nproc", "1", "--node-rank", "1", "x.py"], "--node-rank 1 must be < --nnodes 1"),
        (["--nproc", "1", "--run-id", "exp.e3", "x.py"], "does not end in '.e<digits>'"),
        (["--nproc", "1", "--run-id", "team/exp", "x.py"], "a run id has no ':' or '/'"),
    ],
)
def test_usage_errors(argv: list[str], message: str, capsys, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("PARAMSHARD_RUN", raising=False)
    assert cli.main(["launch", *argv]) == 2
    assert message in capsys.readouterr().err


def test_nproc_must_be_positive(capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as exc:
        cli.main(["launch", "--nproc", "0", "x.py"])
    assert exc.value.code == 2


def test_read_token(tmp_path: Path) -> None:
    f = tmp_path / "t"
    f.write_text("bare-token\n")
    assert read_token(str(f)) == "bare-token"
    f.write_text("admin a-token\n")
    assert read_token(str(f)) == "a-token"
    f.write_text("read r\nadmin a\ntrain t\n")
    assert read_token(str(f)) == "t"
    f.write_text("read r-only\n")
    with pytest.raises(cli.CommandError, match="train or admin"):
        read_token(str(f))
    assert read_token(None) is None


# -------------------------------------------------------------------------------- the example
@pytest.mark.slow
def test_train_gpt_under_launch() -> None:
    result = launch(
        "--nproc", "2", "examples/train_gpt.py", "--strategy", "fsdp", "--steps", "20",
        timeout=200,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[rank 0] OK: the loss went down" in result.stdout.splitlines()
    assert "world size 2" in result.stdout


# ---------------------------------------------------------------------------- the run id rule
@pytest.mark.parametrize(
    ("ours", "torchrun", "want"),
    [
        ("mine", "tr-1", "mine"),  # PARAMSHARD_RUN wins
        (None, "tr-1", "tr-1"),  # a trainer started by torchrun
        ("", "tr-1", "tr-1"),  # empty counts as unset
        (None, "none", None),  # torchrun's static default names no run
        (None, None, None),
    ],
)
def test_run_id_from_env(
    ours: str | None, torchrun: str | None, want: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in (("PARAMSHARD_RUN", ours), ("TORCHELASTIC_RUN_ID", torchrun)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert run_id_from_env() == want
    spec = ClusterSpec(["127.0.0.1:1"])  # no RPC is made
    client = ShardClient(spec)
    assert client.run_id == (want or "run")
    assert ShardClient(spec, run_id="given").run_id == "given"
    client.close()


@pytest.mark.parametrize("torchrun", ["tr-launch", "none"])
def test_launch_takes_torchelastic_run_id(tiny: Path, torchrun: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "paramshard", "launch", "--nproc", "1", str(tiny), "env-only"],
        cwd=ROOT,
        env=launch_env(TORCHELASTIC_RUN_ID=torchrun),
        capture_output=True,
        text=True,
        timeout=RUN_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run = rank_envs(result.stdout)[0]["PARAMSHARD_RUN"]
    if torchrun == "none":
        assert re.fullmatch(r"run-[0-9a-f]{12}", run), run  # "none" is unset: a random id
    else:
        assert run == torchrun
