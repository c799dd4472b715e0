"""The two "hosts" of tests/multihost/test_multihost.py: a ``paramshard serve`` in each server
namespace, and ``paramshard launch`` of trainer.py in each trainer namespace (one node of two),
with the bounded waits for their results and markers."""

from __future__ import annotations

import json
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from numerics import assert_equivalent

from .conftest import NetLab, Proc
from .trainer import WORLD

TRAINER = Path(__file__).resolve().with_name("trainer.py")
SERVERS = ("s0", "s1")
TRAINERS = ("t0", "t1")
STEPS = 10
START_S = 60.0  # a server must print "listening on" within this
RUN_S = 150.0  # a whole training run must end within this


@dataclass
class Shared:
    dir: Path
    token: str
    token_file: Path
    init_file: Path
    reference: dict[str, torch.Tensor]
    uninterrupted: dict[str, torch.Tensor] | None = None
    runs: list[str] = field(default_factory=list)


class Servers:
    """One ``paramshard serve`` per server namespace, all at port 50051, shared snapshot dir."""

    def __init__(self, lab: NetLab, shared: Shared, snapshot_dir: Path) -> None:
        self.lab, self.shared, self.snapshot_dir = lab, shared, snapshot_dir
        snapshot_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, Proc] = {}
        self.starts = 0

    @property
    def addresses(self) -> list[str]:
        return [self.lab.address(h) for h in SERVERS]

    def start(self, host: str) -> float:
        """Starts (or restarts) ``host``'s server; returns the seconds until it listened."""
        began = time.monotonic()
        self.starts += 1
        proc = self.lab.run_in(
            host,
            f"server-{host}-{self.starts}",
            [
                sys.executable,
                "-m",
                "paramshard",
                "serve",
                "--host",
                self.lab.ip[host],
                "--port",
                "50051",
                "--token-file",
                str(self.shared.token_file),
                "--snapshot-dir",
                str(self.snapshot_dir),
            ],
        )
        self.procs[host] = proc
        line = proc.wait_for_line("listening on", START_S)
        assert self.lab.address(host) in line, line
        return time.monotonic() - began

    def kill(self, host: str) -> None:
        proc = self.procs[host]
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"serve" in cmdline, cmdline  # `ip netns exec` exec'd the server: same pid
        proc.kill()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()


def start_trainers(
    lab: NetLab, shared: Shared, servers: Servers, name: str, *args: str
) -> tuple[list[Proc], Path]:
    """Rank R in namespace t{R}, each through ``paramshard launch`` (one node of two)."""
    out = shared.dir / f"{name}.safetensors"
    run, job = f"{name}-{secrets.token_hex(4)}", f"{name}-{secrets.token_hex(4)}"
    procs = []
    for r, host in enumerate(TRAINERS):
        cmd = [
            sys.executable,
            "-m",
            "paramshard",
            "launch",
            "--nnodes",
            str(len(TRAINERS)),
            "--node-rank",
            str(r),
            "--nproc",
            str(WORLD // len(TRAINERS)),
            "--servers",
            ",".join(servers.addresses),
            "--run-id",
            run,
            "--token-file",
            str(shared.token_file),
            "--start-timeout",
            "30",
            str(TRAINER),
            "--init",
            str(shared.init_file),
            "--out",
            str(out),
            "--job",
            job,
            "--steps",
            str(STEPS),
            *args,
        ]
        procs.append(lab.run_in(host, f"{name}-{host}", cmd))
    return procs, out


def finish(procs: list[Proc], timeout: float = RUN_S) -> list[dict]:
    """Waits (bounded) for every trainer; returns the RESULT dicts in rank order."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            code = p.wait(max(0.1, deadline - time.monotonic()))
            assert code == 0, f"{p.name} exited with {code}:\n{p.output()}"
    except BaseException:
        for p in procs:
            p.stop(grace=3)
        raise
    results = []
    for p in procs:
        found = [ln.split("RESULT ", 1)[1] for ln in p.lines if "RESULT " in ln]
        assert len(found) == 1, p.output()
        results.append(json.loads(found[0]))
    return sorted(results, key=lambda r: r["rank"])


def wait_marker(path: Path, procs: list[Proc], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for p in procs:
            assert p.alive(), f"{p.name} exited before {path.name}:\n{p.output()}"
        assert time.monotonic() < deadline, f"no {path} within {timeout:g} s"
        time.sleep(0.02)


def touch(path: Path) -> None:
    path.write_text(str(time.time()))


def assert_same_model(state: dict, ref: dict, what: str) -> None:
    assert state.keys() == ref.keys()
    assert_equivalent(state, ref, what)
