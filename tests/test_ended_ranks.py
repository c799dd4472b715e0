"""A wait for a rank that ended for good fails at once, not at its deadline. The common case:
uneven inputs, a rank that ran out of batches first. Its process exits normally; its release
at exit says so (``LeaseRequest.ends``, client/restarts.py ``ends_for_good``), and a server
wait (a collective's read, a step waiting for gradients) whose missing ranks all ended this
way fails with FAILED_PRECONDITION naming them. A rank that raised, or that ``paramshard
launch --max-restarts`` could start again, did not end for good: its peers wait as before,
and their deadline's error says it released its lease.

Real servers, real processes: the rank that ends is a subprocess (its exit hook is the one
under test); the last case is ``paramshard launch`` of an FSDP script with uneven batches.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import unique_id, worker_env
from launching import launch

from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.finished_ranks import tell_stopped

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 8.0
PEER = """
import sys, time
from paramshard.client import ClusterSpec, ShardClient
address, run, how = sys.argv[1:4]
client = ShardClient(ClusterSpec([address]), rank=0, world_size=2, run_id=run, timeout_s=30)
client.barrier()  # with the test's rank 1
print("met", flush=True)
if how == "raise":
    raise RuntimeError("rank 0 fails")
if how == "hold":  # holds its lease stream until the test kills it
    time.sleep(60)
if how == "close":  # closes its client itself (a finally, with no error), then ends normally
    client.close()
if how == "close-raise":  # closes its client itself while the error propagates
    try:
        raise RuntimeError("rank 0 fails")
    finally:
        client.close()
if how == "close-raise-from":
    try:
        raise KeyError("no batch")
    except KeyError as exc:
        client.close()
        raise RuntimeError("rank 0 fails") from exc
if how.startswith("close-caught"):  # the error is caught, the client closed; then the script
    try:  # ends normally, or with sys.exit(1), or of another error
        raise RuntimeError("an error it gives up on")
    except RuntimeError:
        client.close()
    if how == "close-caught-exit-1":
        sys.exit(1)
    if how == "close-caught-then-raise":
        raise RuntimeError("rank 0 fails")
"""  # else it never closes its client: the exit hook releases its lease, as in most scripts


@pytest.mark.parametrize(
    ("how", "restarts", "then"),
    [
        ("normal", "", "ended"),
        ("close", "", "ended"),
        ("raise", "", "stopped"),
        ("normal", "1", "waits"),
        ("raise", "1", "waits"),
        ("close-raise", "", "stopped"),
        ("close-raise-from", "", "stopped"),
        ("close-caught", "", "ended"),
        ("close-caught-exit-1", "", "ended"),
        ("close-caught-then-raise", "", "stopped"),
        ("interactive", "", "ended"),
    ],
    ids=[
        "ran-out",
        "ran-out-closed",
        "raised",
        "restartable",
        "restartable-raised",
        "closed-raising",
        "closed-raising-from",
        "closed-on-a-caught-error",
        "closed-on-a-caught-error-exit-1",
        "closed-on-a-caught-error-then-another",
        "an-error-shown-at-a-prompt",
    ],
)
def test_a_wait_for_a_rank_that_ended_fails_at_once(
    servers: Any, how: str, restarts: str, then: str
) -> None:
    """A rank whose code raised, and that nothing restarts, posts the run's final notice at its
    exit (client/leases.py): its peers stop at once, naming its error. Before, they waited
    out their deadline, as they still do for a rank its launcher may restart. So does one
    that closed its client itself as the error went up (``finally``, or an ``except`` that
    raises another from it): before, its close released the lease first, and nothing was
    posted; so does one that caught it, closed its client and then died of another error.
    One that closed its client and exited with no uncaught exception, on an error it caught
    or with none (or with ``sys.exit(1)``, whose code no exit hook reads), ended for good, as
    if its exit had closed the client; before, its peers waited out their deadline. An error
    shown at an interactive prompt ends nothing: the session went on, and its end is a
    normal one."""
    address = servers(1, local_calls=False)[0].address
    run = unique_id("ended")
    env = {**worker_env(), "PARAMSHARD_MAX_RESTARTS": restarts}
    # "interactive": the REPL after PEER shows an error, then ends normally (stdin's end)
    prompt = ["-i"] if how == "interactive" else []
    peer = subprocess.Popen(
        [sys.executable, *prompt, "-c", PEER, address, run, how],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    me = ShardClient(ClusterSpec([address]), rank=1, world_size=2, run_id=run, timeout_s=TIMEOUT_S)
    try:
        me.barrier()  # barrier #1, with the peer
        out, err = peer.communicate("raise RuntimeError('shown')\n" if prompt else "", 60)
        assert "met" in out, err
        began = time.monotonic()
        with pytest.raises(ShardClientError) as info:
            me.barrier()  # barrier #2: the peer has gone
        took = time.monotonic() - began
    finally:
        me.close()
        peer.kill()
    details = info.value.details
    if then == "ended":
        assert info.value.code.name == "FAILED_PRECONDITION", info.value
        said = "missing rank(s) 0 ended: their process exited with no uncaught exception"
        assert said in details, details
        assert "all_reduce #2 of run" in details, details
        assert took < TIMEOUT_S / 2, f"it waited {took:.1f} s"
    elif then == "stopped":
        assert info.value.code.name == "ABORTED", info.value
        words = "rank 0 stopped on an error no recovery mends (RuntimeError: rank 0 fails)"
        assert words in details, details
        assert took < TIMEOUT_S / 2, f"it waited {took:.1f} s"
    else:
        assert info.value.code.name == "DEADLINE_EXCEEDED", info.value
        assert "rank 0 released its lease here" in details, details
        assert took > TIMEOUT_S * 0.8, f"it gave up after {took:.1f} s"


def test_the_launchers_notice_waits_for_the_end_of_the_ranks_stream(servers: Any) -> None:
    """``--max-restarts`` will not restart rank 0: the launcher posts the run's final notice for
    it (``tell_stopped``) once its process exited. The server may not have handled the end of
    the rank's lease stream yet, and then refuses the notice as a call from another process
    (ALREADY_EXISTS). Here the launcher's call comes while rank 0 is still alive and the kill
    follows; before, the refusal was taken at once and rank 1 waited out its deadline."""
    address = servers(1, local_calls=False)[0].address
    run = unique_id("held")
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, address, run, "hold"],
        env=worker_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    me = ShardClient(ClusterSpec([address]), rank=1, world_size=2, run_id=run, timeout_s=30)
    told: list[list[str]] = []
    try:
        me.barrier()  # with the peer, which holds its stream from here on
        why = "failed with exit code 1: ValueError: bad batch 3"
        teller = threading.Thread(
            target=lambda: told.append(tell_stopped([address], None, run, 0, 2, why))
        )
        teller.start()
        time.sleep(0.5)  # the launcher's first ask meets the open stream
        peer.kill()
        peer.communicate(timeout=30)
        teller.join(timeout=30)
        began = time.monotonic()
        with pytest.raises(ShardClientError) as info:
            me.barrier()
        took = time.monotonic() - began
    finally:
        me.close()
        peer.kill()
    assert told == [[]], told
    assert info.value.code.name == "ABORTED", info.value
    assert "bad batch 3" in info.value.details, info.value.details
    assert took < 5, f"rank 1 waited {took:.1f} s"


UNEVEN = """
import os, sys, time
import torch
from paramshard import FSDPModel, FSDPOptimizer, ShardingConfiguration
from paramshard.strategies import train_with_recovery
rank = int(os.environ["RANK"])
config = ShardingConfiguration.from_env(job="uneven", timeout_s=60)
torch.manual_seed(0)
model = FSDPModel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), config)
opt = FSDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
batches = 2 if rank == 0 else 4  # rank 0 runs out of batches first

def step(s):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return 0.0

began = time.monotonic()
try:
    if sys.argv[1] == "recovery":
        train_with_recovery(model, step, batches, checkpoint_every=0, wait_s=60)
    else:
        for s in range(model.step_count, batches):
            step(s)
        if sys.argv[1] == "closes":  # its release comes before its exit: it cannot say "ends"
            config.client.close()
finally:
    print(f"rank {rank} after {time.monotonic() - began:.1f} s", flush=True)
"""


@pytest.mark.parametrize("restarts", ["0", "1"], ids=["no-restarts", "max-restarts-1"])
@pytest.mark.parametrize("loop", ["plain", "recovery", "closes"])
def test_uneven_inputs_end_the_job_at_once(tmp_path: Path, restarts: str, loop: str) -> None:
    """Rank 1's third step waits for rank 0's gradient; rank 0 exited after two: rank 1 fails
    within seconds (its deadline is 60 s), naming rank 0, and the launcher stops the job.

    Under ``--max-restarts`` rank 0's own release cannot say it ended (its exit code is the
    launcher's to see), nor where the script closes its own client (its release comes before
    its exit): the launcher says so once it exited 0 (paramshard/finished_ranks.py).
    Before, rank 1 waited its 60 s, was restarted, and waited 60 s again (a field review: 253 s
    at the default 120). In ``train_with_recovery`` the refusal is not a lost server: before,
    rank 1 said "server 0 ... lost" and recovered five times, all its ``max_recoveries``."""
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN)
    began = time.monotonic()
    result = launch("--nproc", "2", "--max-restarts", restarts, script, loop, timeout=240)
    took = time.monotonic() - began
    said = result.stdout + result.stderr
    assert result.returncode == 1, said
    assert "missing rank(s) 0 ended: their process exited with no uncaught exception" in said, said
    assert "FAILED_PRECONDITION" in said, said
    assert " lost at step" not in said, said  # no server was lost
    # a restart of rank 1 (its budget) meets the same refusal at once
    assert took < 45 + 15 * int(restarts), f"the job took {took:.0f} s (rank 1's deadline: 60 s)"
