"""A node down in a fixed-world job: a rank and its server SIGKILLed together, both started
again by ``paramshard launch --max-restarts 1 --max-server-restarts 1``.

The rank that runs on recovers from losing the server (``train_with_recovery``) behind
barriers of the whole world. The restarted rank finds the job at step N on one server and
holding no values on the other, restarted empty: it joins that recovery, in the running rank's
epoch, while rank 0 restores the job (strategies/data_parallel/checkpoints.py,
``_join_recovery``), and takes no snapshot as it starts, the others taking none there. Before,
it raised "several versions [0, N]" and spent its restart, and the job stopped (a field run
with ``--max-restarts 2``: both spent).

Float64 FSDP as tests/test_launch_server_restarts.py: the final parameters must equal
single-process training (1e-9). Node 1 with replicas every step (rank 0 runs on and restores
from them) and node 0 with snapshots every 3 steps (the restarted rank 0 restores the one of
step 6, where it joins). A restarted rank whose server is empty while no running rank
recovers it (they do not run ``train_with_recovery``) says so after its client's
``timeout_s``; one that finds the notice of an earlier recovery, before the running rank
noticed this loss, meets it past its next one (in-process ranks). And a rank restarted
alone, its server fine, after a recovery the others made: it comes in their epoch, not in
epoch 0 where that recovery's notice refuses its waits. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import worker_env
from launching import wait_gone
from numerics import assert_equivalent
from test_elastic import INIT, LR, net
from test_job_lost import JOB, both_trained
from test_launch_server_restarts import (
    KILL_AT,
    SEED,
    STEPS,
    TRAIN,
    Launcher,
    single_process,
    started,
)

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.restarts import RESTART_COUNT_ENV, RESTART_FILE_ENV
from paramshard.protos import shard_pb2 as pb
from paramshard.strategies import FSDPModel, FSDPOptimizer, ShardingConfiguration

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


@contextlib.contextmanager
def rank_1_again(
    addresses: list[str], run: str, timeout_s: float
) -> Iterator[tuple[ShardClient, FSDPModel]]:
    """Rank 1's new process (the caller sets ``RESTART_COUNT_ENV``): its client and model,
    not attached yet (``attach``); the client closes after."""
    client = ShardClient(ClusterSpec(addresses), rank=1, world_size=2, run_id=run,
                         timeout_s=timeout_s)  # fmt: skip
    try:
        config = ShardingConfiguration(client, job=JOB, replicate_every=1)
        yield client, FSDPModel(net(INIT), config, wrap=(torch.nn.Linear,))
    finally:
        client.close()


def attach(model: FSDPModel) -> FSDPOptimizer:
    """The optimizer wrapper, where the model registers on the servers and meets the job."""
    return FSDPOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), model.config)


def pids_of_ranks(said: str) -> dict[int, int]:
    """Each rank's first process (the script prints its pid first)."""
    found: dict[int, int] = {}
    for r, pid in re.findall(r"^\[rank (\d)\] pid (\d+)$", said, re.M):
        found.setdefault(int(r), int(pid))
    return found


def killed_at_step_6(
    tmp_path: Path, mode: str, restarts: tuple[str, ...], victims: Callable[[str], list[int]]
) -> str:
    """TRAIN under ``paramshard launch --nproc 2`` with ``restarts`` (its --max-* options):
    once rank 0 waits at step ``KILL_AT`` (rank 1 in its step), SIGKILLs the pids ``victims``
    finds in the output so far, then lets rank 0 go on. The job must exit 0, ending at the
    parameters of single-process training (1e-9); returns the output."""
    script, out, marker = tmp_path / "train.py", tmp_path / "final.pt", tmp_path / "killed"
    script.write_text(TRAIN)
    launcher = Launcher("--nproc", "2", *restarts, script, out, marker, mode, STEPS, KILL_AT, SEED)
    try:
        launcher.wait_for(r"^\[rank 0\] KILL ME")
        pids = victims(launcher.output)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        assert wait_gone(pids) == []
        marker.write_text("killed")
        code = launcher.finish()
    finally:
        launcher.close()
    said = launcher.output
    assert code == 0, said
    data = torch.randint(0, 50, (STEPS, 4, 17), generator=torch.Generator().manual_seed(SEED + 1))
    final = torch.load(out, weights_only=True)
    assert_equivalent(final, single_process(data), f"{mode}: {pids} killed at step {KILL_AT}")
    assert wait_gone([pid for _, _, pid in started(said)]) == []
    return said


@pytest.mark.equivalence
@pytest.mark.slow
@pytest.mark.parametrize(("node", "mode"), [(1, "recover"), (0, "snapshots")])
def test_a_rank_and_its_server_lost_together_are_recovered(
    node: int, mode: str, tmp_path: Path
) -> None:
    def node_down(said: str) -> list[int]:
        (server,) = [pid for i, _, pid in started(said) if i == node]
        return [pids_of_ranks(said)[node], server]

    said = killed_at_step_6(
        tmp_path, mode, ("--max-restarts", "1", "--max-server-restarts", "1"), node_down
    )
    assert f"server {node} exited (exit code -9); started it again, empty" in said, said
    assert re.search(rf"rank {node} failed with exit code -?\d+; restarting it", said), said
    assert re.search(
        rf"^\[rank {node}\] .*rank {node}: job 'relaunched' holds no values on a server restarted"
        r" empty: this rank joins the running ranks' recovery \(epoch 1\)$",
        said,
        re.M,
    ), said
    other = 1 - node
    assert re.search(rf"^\[rank {other}\] recoveries 1 replayed [01]$", said, re.M), said
    assert re.search(rf"^\[rank {node}\] recoveries 0 replayed 0$", said, re.M), said


def test_a_restarted_rank_whose_server_nobody_recovers_says_so(servers, monkeypatch) -> None:
    """Before, it raised "several versions [0, N]" at once; now it waits for the running
    ranks' recovery, bounded by its client's ``timeout_s``, then names what is missing."""
    addresses = [s.address for s in servers(2)]
    ranks = both_trained(addresses, "nobody", elastic=False)
    try:
        ranks[1][0].close()  # rank 1's process ended, and server 1 restarted empty
        ranks[0][0].call(1, "DropJob", pb.DropJobRequest(job=JOB))
        monkeypatch.setenv(RESTART_COUNT_ENV, "1")  # its new process
        with rank_1_again(addresses, "nobody", timeout_s=2) as (_, model):
            with pytest.raises(
                RuntimeError, match="no running rank said it recovers it within 2 s"
            ):
                attach(model)
    finally:
        ranks[0][0].close()


AGAIN = """
import sys
sys.path.insert(0, sys.argv[3])
from test_launch_node_down import attach, rank_1_again
with rank_1_again(sys.argv[1].split(","), sys.argv[2], timeout_s=30) as (client, model):
    attach(model)
    state = client.run_state
    print("CAME", model.step_count, state.epoch, state.took_over, flush=True)
"""


def test_a_node_whose_launch_is_run_again_joins_the_recovery(servers) -> None:
    """Node 1 went down whole (its launcher too) and its operator ran its launch command
    again: rank 1's new process is its launcher's first (no ``PARAMSHARD_RESTART_COUNT``), but
    the servers saw an earlier process of rank 1 in this run (``LeaseReply.took_over``), so it
    joins rank 0's recovery as a restarted rank does. Before, it raised "several versions
    [0, N]" and rank 0 waited out its deadline (a field check)."""
    addresses = [s.address for s in servers(2)]
    (c0, m0, _), (c1, _, _) = both_trained(addresses, "again", elastic=False)
    c1.close()  # rank 1's process ended, and server 1 restarted empty
    c0.call(1, "DropJob", pb.DropJobRequest(job=JOB))
    env = {k: v for k, v in worker_env().items() if k != RESTART_COUNT_ENV}
    tests = str(Path(__file__).resolve().parent)
    child = subprocess.Popen(
        [sys.executable, "-c", AGAIN, ",".join(addresses), "again", tests],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        c0.run_state.give_up("recovers: server 1 lost")  # rank 0 notices, in epoch 0
        m0.restart_collectives(1)
        restored = m0.recover()
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
        c0.close()
    assert f"CAME {restored} 1 True" in out, out + err


def test_a_restarted_rank_that_finds_the_run_ended_stops_at_once(
    servers, monkeypatch, tmp_path
) -> None:
    """Rank 0 gave the run up for good (``--max-restarts`` used up: its launcher posted the
    final notice) as node 1 went down; rank 1's new process finds its server empty and that
    notice. It stops at once, telling its launcher the notice so as not to be restarted.
    Before, it took the notice's epoch + 1, 2**32 + 1, which no lease can carry: its renewals
    failed every second ("Value out of range") while it waited out its deadline (a field
    check)."""
    addresses = [s.address for s in servers(2)]
    ranks = both_trained(addresses, "ended", elastic=False)
    try:
        ranks[1][0].close()  # rank 1's process ended, and server 1 restarted empty
        ranks[0][0].call(1, "DropJob", pb.DropJobRequest(job=JOB))
        ranks[0][0].run_state.give_up("failed with exit code 1: ValueError: bad batch", True)
        declared = tmp_path / "declared"
        monkeypatch.setenv(RESTART_COUNT_ENV, "1")  # its new process
        monkeypatch.setenv(RESTART_FILE_ENV, str(declared))
        began = time.monotonic()
        with rank_1_again(addresses, "ended", timeout_s=30) as (_, model):
            with pytest.raises(RuntimeError, match="the run ended: .*bad batch") as info:
                attach(model)
        took = time.monotonic() - began
    finally:
        ranks[0][0].close()
    assert took < 10, f"it stopped after {took:.1f} s (its deadline: 30 s)"
    assert "restarted empty" in str(info.value), info.value
    assert re.search(r"^stopped 1 .*bad batch$", declared.read_text(), re.M), declared.read_text()


def test_a_notice_older_than_the_others_epoch_is_passed_by_their_next(
    servers, monkeypatch, caplog
) -> None:
    """The run recovered once before (a notice of epoch 0, the ranks then at epoch 1), and
    rank 1's new process finds its server emptied before rank 0 noticed the loss: it meets in
    epoch 1, where rank 0 is not recovering (that epoch's first barrier long freed), then, once
    rank 0 recovers, in epoch 2 with it, and comes at the step rank 0 restored."""
    addresses = [s.address for s in servers(2)]
    ranks = both_trained(addresses, "stale", elastic=False)
    (c0, m0, _), (c1, m1, _) = ranks
    c0.run_state.give_up("recovers: an earlier failure")  # the notice of epoch 0

    def earlier_recovery(model: FSDPModel) -> None:
        model.restart_collectives(1)
        model.client.barrier()

    threads = [threading.Thread(target=earlier_recovery, args=(m,)) for m in (m0, m1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    c1.close()  # rank 1's process died with server 1
    c0.call(1, "DropJob", pb.DropJobRequest(job=JOB))
    monkeypatch.setenv(RESTART_COUNT_ENV, "1")
    came: list = []

    def comes() -> None:
        try:
            with rank_1_again(addresses, "stale", timeout_s=30) as (client, model):
                attach(model)
                came.append((model.step_count, client.run_state.epoch))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            came.append(exc)

    caplog.set_level(logging.WARNING, logger="paramshard.recovery")
    newcomer = threading.Thread(target=comes)
    newcomer.start()
    try:
        deadline = time.monotonic() + 60
        while "not their recovery's epoch" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "not their recovery's epoch" in caplog.text, caplog.text
        c0.run_state.give_up("recovers: server 1 lost")  # rank 0 notices, in epoch 1
        m0.restart_collectives(2)
        restored = m0.recover()
        newcomer.join(60)
        assert came == [(restored, 2)], came
    finally:
        newcomer.join(60)
        c0.close()


def test_a_rank_restarted_alone_after_a_recovery_comes_in_the_others_epoch(
    servers, monkeypatch
) -> None:
    """Its server fine, rank 1's new process finds the notice of a recovery the others made
    before (epoch 0; they are in epoch 1) and moves past it. Before, it stayed in epoch 0, where
    that notice refused its first wait: every rank recovered once more, the notice blaming the
    server it called (a field run under the launcher)."""
    addresses = [s.address for s in servers(2)]
    (c0, m0, _), (c1, m1, _) = both_trained(addresses, "alone", elastic=False)
    c0.run_state.give_up("recovers: an earlier failure")  # the notice of epoch 0
    for m in (m0, m1):
        m.restart_collectives(1)
    c1.close()  # rank 1's process died; its server did not
    monkeypatch.setenv(RESTART_COUNT_ENV, "1")
    try:
        with rank_1_again(addresses, "alone", timeout_s=10) as (client, model):
            attach(model)
            assert model.step_count == m0.step_count
            assert client.run_state.epoch == 1 and client.run_state.current() is None
    finally:
        c0.close()
