"""A rank whose own code raises inside ``train_with_recovery`` stops the others at once, naming
it and the error (strategies/recovery_rounds.py ``stop_the_others``). Before, they took its
silence for a lost server: each recovery waited out its deadline for the rank, more than ten
minutes with the defaults, each saying "server 0 lost" (seen: 4 recoveries in 6 minutes with
a 120 s deadline, against 1.1 s now). An elastic job's members train on without it.

Real in-process servers; ranks are threads.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

import pytest
import torch
from hybrid_runs import run_hybrid
from launching import launch, launch_nodes
from two_ranks import sgd_step, two_fsdp_ranks

from paramshard.client import ShardClientError
from paramshard.client.restarts import read_declaration
from paramshard.strategies import (
    train_with_recovery,
)

pytestmark = pytest.mark.timeout(120)
STEPS, BAD = 8, 3
WORDS = f"rank 1 stopped at step {BAD} on an error no recovery mends (ValueError: bad batch {BAD})"


def fsdp_ranks(
    addresses: list[str], elastic: bool, error: BaseException | None = None
) -> dict[int, object]:
    """Two ranks train STEPS steps; rank 1's step BAD raises ``error`` (a ValueError by
    default). What each returned or raised. Their deadline is one the test would not
    outlast: were the others to wait it out, the test fails."""

    def body(r: int, model, opt):
        def step(s: int) -> float:
            if r == 1 and s == BAD:
                raise error or ValueError(f"bad batch {s}")
            return sgd_step(model, opt, torch.ones(2, 4))

        return train_with_recovery(model, step, STEPS, checkpoint_every=0)

    job = f"stop-{uuid.uuid4().hex[:6]}"
    return two_fsdp_ranks(addresses, job, body, elastic, timeout_s=300)


def test_a_rank_that_raises_stops_the_others_naming_it(servers) -> None:
    out = fsdp_ranks([s.address for s in servers(2)], elastic=False)
    assert isinstance(out[1], ValueError), out  # its own error, as it was
    assert isinstance(out[0], ShardClientError) and out[0].code.name == "ABORTED", out
    assert WORDS in out[0].details, out[0]


class Unreadable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception raises")


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (ValueError("\nbad batch 3\nmore"), "ValueError: bad batch 3"),
        (
            ValueError("cannot open " + os.fsdecode(b"data-\xff.bin")),
            r"ValueError: cannot open data-\udcff",
        ),
        (Unreadable(), "Unreadable: (its message could not be read)"),
    ],
    ids=["leading-newline", "not-utf8", "str-raises"],
)
def test_any_error_stops_the_others_in_words(servers, error, said) -> None:
    """Before, a message that began with a newline read "ValueError: "; one holding a file name
    that is not UTF-8 could not be written or sent, so nobody was told (the others waited out
    their deadline); and one whose str() raised made the stop itself raise."""
    out = fsdp_ranks([s.address for s in servers(2)], elastic=False, error=error)
    assert out[1] is error, out
    assert isinstance(out[0], ShardClientError) and out[0].code.name == "ABORTED", out
    assert f"on an error no recovery mends ({said}" in out[0].details, out[0]


def test_an_elastic_job_trains_on_without_it(servers) -> None:
    out = fsdp_ranks([s.address for s in servers(2)], elastic=True)
    assert isinstance(out[1], ValueError), out
    assert not isinstance(out[0], BaseException), out[0]
    assert max(out[0].losses) == STEPS - 1, out[0].losses  # every step, alone from step BAD


def test_a_3d_rank_that_raises_stops_the_others(servers) -> None:
    addresses = [s.address for s in servers(2)]

    def body(model, opt, train):
        rank = model.config.client.rank

        def step(s: int) -> float:
            if rank == 1 and s == BAD:
                raise ValueError(f"bad batch {s}")
            return train(s)

        try:
            return train_with_recovery(model, step, STEPS, checkpoint_every=0)
        except BaseException as exc:  # noqa: BLE001 - read below
            return exc

    out = run_hybrid(2, 1, 1, addresses, f"stop3d-{uuid.uuid4().hex[:6]}", body)
    assert isinstance(out[1], ValueError), out
    assert isinstance(out[0], ShardClientError) and WORDS in out[0].details, out


RANK_SCRIPT = f"""
import atexit, sys, time, torch
from paramshard.strategies import FSDPModel, FSDPOptimizer, ShardingConfiguration
from paramshard.strategies import train_with_recovery
config = ShardingConfiguration.from_env(job="blame")
torch.manual_seed(0)
model = FSDPModel(torch.nn.Linear(4, 2), config)
opt = FSDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
def step(s):
    if config.rank == 1 and s == {BAD}:
        atexit.register(time.sleep, 2)  # a slow teardown (a data loader's workers, say)
        sys.exit(3)
    loss = model(torch.ones(2, 4)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()
train_with_recovery(model, step, {STEPS}, checkpoint_every=0)
"""


def test_the_launcher_names_the_rank_that_raised(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    done = launch("--nproc", "2", script, timeout=100)
    said = re.findall(r"paramshard launch: (rank \d failed .*)", done.stderr)
    assert done.returncode == 3, (done.returncode, said, done.stderr[-3000:])
    assert said and said[0].startswith("rank 1 failed with exit code 3: SystemExit: 3"), said


def test_a_launcher_without_the_rank_that_raised_names_it_from_the_notice(
    tmp_path: Path, servers
) -> None:
    """Two hosts' launchers, a rank each (``--nnodes 2``): rank 1's code raises. Its launcher
    names it and the error; rank 0's launcher, which cannot read rank 1's declaration, names
    it through the notice rank 0 stopped on. Before, it said only "rank 0 failed with exit
    code 1"."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.replace("sys.exit(3)", f"raise ValueError('bad batch {BAD}')"))
    addresses = ",".join(s.address for s in servers(2))
    run = f"hosts-{uuid.uuid4().hex[:6]}"
    ended = launch_nodes("--servers", addresses, "--run-id", run, script, timeout=100)
    codes, errs = [code for code, _, _ in ended], [err for _, _, err in ended]
    said = [re.findall(r"paramshard launch: (rank \d failed .*)", err) for err in errs]
    assert codes == [1, 1], (said, errs[0][-3000:])
    raised = f"rank 1 failed with exit code 1: ValueError: bad batch {BAD}"
    assert said[1] and said[1][0].startswith(raised), said
    assert said[0] and said[0][0].startswith(
        f"rank 0 failed with exit code 1: on the run's notice: run '{run}': {WORDS}"
    ), said


def test_a_rank_out_of_restarts_is_named_with_its_error(tmp_path: Path) -> None:
    """``--max-restarts 1``: rank 1 raises, is restarted, resumes at the same step and raises
    again. The launcher names its error. Before, it said only "rank 1 failed with exit code 1
    (not restarted: --max-restarts 1 used up)": a rank the launcher may restart stops nobody,
    so it had declared nothing."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.replace("sys.exit(3)", f"raise ValueError('bad batch {BAD}')"))
    done = launch("--nproc", "2", "--max-restarts", "1", script, timeout=100)
    said = re.findall(r"paramshard launch: (rank \d failed .*)", done.stderr)
    assert done.returncode == 1, (done.returncode, said, done.stderr[-3000:])
    assert said[0].startswith(f"rank 1 failed with exit code 1: ValueError: bad batch {BAD};"), said
    assert "restarting it" in said[0], said
    assert said[-1].startswith(
        f"rank 1 failed with exit code 1: ValueError: bad batch {BAD} (not restarted:"
    ), said


def test_a_malformed_declaration_is_read_without_a_traceback(tmp_path: Path) -> None:
    """The launcher reads what a rank wrote: a count that ``str.isdigit`` takes and ``int``
    does not (``²``), and bytes that are not UTF-8, crashed it with a traceback."""
    path = tmp_path / "rank-1"
    path.write_bytes(b"fsdp servers\nerror \xc2\xb2 x\nerror 0 ValueError: bad \xff\nstopped\n")
    said = read_declaration(str(path))
    assert said.strategies == ("fsdp",) and said.stops == ()
    assert said.error(0) == "ValueError: bad \ufffd"


def test_another_hosts_rank_out_of_restarts_stops_this_hosts_ranks_at_once(
    tmp_path: Path, servers
) -> None:
    """``--nnodes 2 --max-restarts 1``: rank 1 raises at step BAD in each of its processes.
    Its launcher, out of restarts, posts the run's final notice for it, and rank 0 on the
    other host stops at once, naming it. Before, rank 0 waited for a restart that would
    never come (``PARAMSHARD_REJOIN_TIMEOUT_S``, 120 s) and then its deadline."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.replace("sys.exit(3)", f"raise ValueError('bad batch {BAD}')"))
    addresses = ",".join(s.address for s in servers(2))
    run = f"hosts-{uuid.uuid4().hex[:6]}"
    began = time.monotonic()
    ended = launch_nodes(
        "--servers", addresses, "--run-id", run, "--max-restarts", "1", script, timeout=100
    )
    took = time.monotonic() - began
    said = [re.findall(r"paramshard launch: (rank \d failed .*)", err) for _, _, err in ended]
    assert [code for code, _, _ in ended] == [1, 1], (said, ended[0][2][-3000:])
    gave_up = f"rank 1 failed with exit code 1: ValueError: bad batch {BAD} (not restarted:"
    assert said[1][-1].startswith(gave_up), said
    assert said[0] and said[0][0].startswith(
        f"rank 0 failed with exit code 1: on the run's notice: run '{run}': {gave_up[:-15]}"
    ), said
    assert took < 60, f"{took:.0f} s"  # the restart's wait is 120 s


@pytest.mark.parametrize(
    ("ends", "posted"),
    [
        ("raise ValueError('bad data file')", "rank 1 stopped on an error no recovery mends"),
        ("config.client.close()\n    sys.exit(2)", "rank 1 failed with exit code 2"),
    ],
    ids=["raises", "closes-and-exits"],
)
def test_a_rank_that_ends_before_training_stops_the_other_hosts_ranks_at_once(
    tmp_path: Path, servers, ends: str, posted: str
) -> None:
    """``--nnodes 2``, no restarts: rank 1 ends with an error after building its model, before
    ``train_with_recovery`` (which would have told the others itself). Either its exit posts
    the run's final notice (an exception nothing caught: client/leases.py), or, where nothing
    went uncaught (it closed its client and exited 2), its launcher does, as for any rank it
    does not restart. Rank 0 on the other host stops at once, naming it. Before, only a
    launcher with ``--max-restarts`` posted one: rank 0 waited out its deadline (120 s), then
    blamed server 1 and recovered, up to ``max_recoveries`` times (a field check)."""
    script = tmp_path / "rank.py"
    script.write_text(
        RANK_SCRIPT.replace(
            "train_with_recovery(model, step,",
            f"if config.rank == 1:\n    {ends}\ntrain_with_recovery(model, step,",
        )
    )
    addresses = ",".join(s.address for s in servers(2))
    run = f"hosts-{uuid.uuid4().hex[:6]}"
    began = time.monotonic()
    ended = launch_nodes("--servers", addresses, "--run-id", run, script, timeout=100)
    took = time.monotonic() - began
    said = [re.findall(r"paramshard launch: (rank \d failed .*)", err) for _, _, err in ended]
    codes = [code for code, _, _ in ended]
    assert codes[0] == 1 and codes[1] in (1, 2), (said, ended[0][2][-3000:])
    assert said[1] and said[1][0].startswith("rank 1 failed with exit code"), said
    assert said[0] and said[0][0].startswith(
        f"rank 0 failed with exit code 1: on the run's notice: run '{run}': {posted}"
    ), said
    assert took < 60, f"{took:.0f} s"  # rank 0's deadline is 120 s
