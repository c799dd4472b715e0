"""Chaos for elastic training: trainers killed and added at random steps, bounded in count and
time, and the job still ends where single-process float64 training on the same global batches
ends (1e-9).

The job is tests/elastic_job.py (FSDP, float64, ``batch_part``, AdamW, clipping, an LR
schedule) as real processes on 2 in-process servers, at most 5 ranks. The schedule is drawn from
a seed: up to 3 SIGKILLs from outside, each when the job reaches a random step plus a random
delay (so a rank dies anywhere in a step: in its forward, mid-push, in the Step), never the last
rank alive; and up to 3 ranks added when the job reaches random steps (new ranks, or a killed
rank's id started again). Every rank still running at the end must finish, and each one's
final parameters must equal the single-process run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from elastic_job import single_process
from numerics import assert_equivalent

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.membership import ELASTIC_ENV, MIN_NPROC_ENV
from paramshard.server import ShardServer

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).resolve().parent / "elastic_job.py"
STEPS, WORLD, LIMIT_S = 20, 5, 600.0
pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(int(LIMIT_S) + 120)]


def plan(seed: int) -> tuple[list[tuple[int, float, int]], list[tuple[int, int]]]:
    """(kills: (step, delay s, which running rank by index), adds: (step, rank id))."""
    rng = random.Random(seed)
    kills = sorted(
        (rng.randrange(2, STEPS - 4), rng.random() * 0.5, rng.randrange(3))
        for _ in range(rng.randint(1, 3))
    )
    ids = [3, 4, *rng.sample(range(3), 3)]  # new ranks first, then ids that may have died
    adds = sorted((rng.randrange(2, STEPS - 3), ids[i]) for i in range(rng.randint(1, 3)))
    return kills, adds


class Ranks:
    """The rank processes of one job, started and killed by the test."""

    def __init__(self, addresses: list[str], out: Path, run: str) -> None:
        self.addresses, self.out, self.run = addresses, out, run
        self.procs: dict[int, subprocess.Popen] = {}
        self.lives: dict[int, int] = {}
        self.ended: list[tuple[int, int, int]] = []  # (rank, life, exit code) of past lives
        self.log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 - closed in close()

    def start(self, rank: int) -> None:
        life = self.lives.get(rank, -1) + 1
        if rank in self.procs:
            self.ended.append((rank, life - 1, self.procs[rank].returncode))
        self.lives[rank] = life
        env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSHARD_")}
        env.update(
            RANK=str(rank), WORLD_SIZE=str(WORLD), LIFE=str(life), OMP_NUM_THREADS="1",
            PARAMSHARD_SERVERS=",".join(self.addresses), PARAMSHARD_RUN=self.run,
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
            **{ELASTIC_ENV: "1", MIN_NPROC_ENV: "1"},
        )  # fmt: skip
        self.procs[rank] = subprocess.Popen(
            [sys.executable, str(JOB), str(STEPS), str(self.out)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def running(self) -> list[int]:
        return sorted(r for r, p in self.procs.items() if p.poll() is None)

    def kill(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGKILL)
        self.procs[rank].wait(30)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)
        self.log.close()


def job_version(client: ShardClient) -> int:
    rows = [j for j in client.call(0, "Status", _status()).jobs if j.job == "elastic"]
    return min((b.version for b in rows[0].buffers), default=0) if rows else 0


def _status():
    from paramshard.protos import shard_pb2 as pb

    return pb.StatusRequest()


@pytest.mark.equivalence
@pytest.mark.parametrize("seed", [11, 23])
def test_random_kills_and_joins_end_equal_to_one_process(tmp_path: Path, seed: int) -> None:
    kills, adds = plan(seed)
    servers = [ShardServer("127.0.0.1", 0).start() for _ in range(2)]
    addresses = [s.address for s in servers]
    ranks = Ranks(addresses, tmp_path / "job", f"chaos{seed}")
    probe = ShardClient(ClusterSpec(addresses), timeout_s=10)
    done: list[str] = []
    try:
        for r in range(3):
            ranks.start(r)
        deadline = time.monotonic() + LIMIT_S
        while ranks.running() and time.monotonic() < deadline:
            version = job_version(probe)
            while adds and adds[0][0] <= version:
                _, rank = adds.pop(0)
                if rank not in ranks.running():
                    ranks.start(rank)
                    done.append(f"start rank {rank} (life {ranks.lives[rank]}) at step {version}")
            if kills and kills[0][0] <= version:
                step, delay, pick = kills.pop(0)
                time.sleep(delay)
                alive = ranks.running()
                if len(alive) > 1:  # never the last one
                    victim = alive[pick % len(alive)]
                    ranks.kill(victim)
                    done.append(f"kill rank {victim} at step {step} + {delay:.2f} s")
            time.sleep(0.05)
        assert not ranks.running(), f"ranks {ranks.running()} still running after {LIMIT_S} s"
    finally:
        probe.close()
        ranks.close()
        for s in servers:
            s.stop(0)
    log = (tmp_path / "job.log").read_text()
    codes = ranks.ended + [(r, ranks.lives[r], p.returncode) for r, p in ranks.procs.items()]
    failed = [(r, life, code) for r, life, code in codes if code not in (0, -signal.SIGKILL)]
    assert not failed, f"(rank, life, exit code) {failed}: {log[-6000:]}"
    finished = sorted(tmp_path.glob("job.rank*.pt"))
    # every rank that exited 0 wrote its result (a rank killed just after writing one, as the
    # job ended, leaves a file too: it is checked like the others)
    wrote = {int(path.name.split(".rank")[1].split(".")[0]) for path in finished}
    assert {r for r, _, code in codes if code == 0} <= wrote, log[-4000:]
    want = single_process(STEPS)
    for path in finished:
        assert_equivalent(torch.load(path), want, f"chaos seed {seed}: {path.name}")
    print(f"chaos seed {seed}: {'; '.join(done)}; {len(finished)} rank(s) finished")
