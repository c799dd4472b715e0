"""A job no server, replica or snapshot holds any more (a server and the neighbour holding its
replica both lost, no snapshot: field review): every rank learns so at once, and the launcher
does not restart a rank for it.

- The recovery round's leader raises ``JobLost`` and tells the others (an abort notice): a
  member waiting for its restore stops waiting, recovers again in a new epoch and finds the
  job lost itself. Before, it waited for the leader's ``done`` until ``elastic_wait_s`` (the
  review's runs: killed at 200-241 s).
- A rank that comes late to a round whose members were all lost leads it (the coordinator
  names it; before, the rank did not act on it and waited ``elastic_wait_s``).
- A fixed-world job raises ``JobLost`` too (before: the restore's NOT_FOUND, which
  ``train_with_recovery`` tried again five times).
- The rank says so in its restart file, and ``paramshard launch`` does not restart it: a new
  process would train the job anew from step 0 and call that continuous (the review's runs).

Real in-process servers on 127.0.0.1; ranks are threads.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from test_elastic import INIT, LR, net, vanish
from test_elastic_rebuild import train

from paramshard.client import ClusterSpec, ShardClient, ShardClientError, restarts
from paramshard.client.membership import Membership
from paramshard.protos import shard_pb2 as pb
from paramshard.restarts import RankRestarts
from paramshard.strategies import FSDPModel, FSDPOptimizer, JobLost, ShardingConfiguration

pytestmark = pytest.mark.timeout(300)
JOB = "lost"
WAIT_S = 60.0  # elastic_wait_s: the bound a member waited for a leader that gave up


def rank(addresses: list[str], r: int, run: str, elastic: bool = True) -> tuple:
    client = ShardClient(
        ClusterSpec(addresses), rank=r, world_size=2, run_id=run, timeout_s=30, retries=1
    )
    config = ShardingConfiguration(
        client, job=JOB, elastic=elastic, replicate_every=1, join_window_s=1.0,
        elastic_wait_s=WAIT_S,
    )  # fmt: skip
    model = FSDPModel(net(INIT), config, wrap=(torch.nn.Linear,))
    opt = FSDPOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), config)
    return client, model, opt


def both_trained(addresses: list[str], run: str, elastic: bool = True) -> list:
    """Ranks 0 and 1 (threads) built and trained: each rank's (client, model, optimizer)."""
    ranks = [None, None]

    def builds(r: int) -> None:
        ranks[r] = rank(addresses, r, run, elastic)
        train(ranks[r][1], ranks[r][2])

    threads = [threading.Thread(target=builds, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(ranks), "the ranks did not train"
    return ranks


def both_trained_then_lost(addresses: list[str], run: str, elastic: bool = True) -> list:
    ranks = both_trained(addresses, run, elastic)
    for i in range(2):  # both servers restarted empty
        ranks[0][0].call(i, "DropJob", pb.DropJobRequest(job=JOB))
    return ranks


def in_threads(calls: dict[int, object]) -> dict[int, tuple[object, float]]:
    """Runs each rank's call in a thread: what it returned or raised, and when."""
    out: dict[int, tuple[object, float]] = {}
    began = time.monotonic()

    def runs(r: int, call) -> None:  # noqa: ANN001
        try:
            got: object = call()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            got = exc
        out[r] = (got, time.monotonic() - began)

    threads = [threading.Thread(target=runs, args=item, daemon=True) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S + 30)
    assert len(out) == len(calls), f"still waiting after {WAIT_S + 30:.0f} s: {out}"
    return out


def test_the_leaders_job_lost_ends_the_others_wait_and_they_find_it_lost(
    servers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    declared = tmp_path / "rank-0"
    monkeypatch.setenv(restarts.RESTART_FILE_ENV, str(declared))
    ranks = both_trained_then_lost([s.address for s in servers(2)], "lost-e")
    try:
        for _, model, _ in ranks:
            model.restart_collectives(1)
        got = in_threads({r: (lambda m=m: m.resync(1, 0.0)) for r, (_, m, _) in enumerate(ranks)})
        leader, waited = got[0][0], got[1]
        assert isinstance(leader, JobLost), got
        exc, after = waited
        assert isinstance(exc, ShardClientError) and exc.code == grpc.StatusCode.ABORTED, got
        assert "cannot be recovered" in exc.details and after < WAIT_S / 2, got
        ranks[1][1].restart_collectives(2)  # it recovers again: the job is lost for it too
        with pytest.raises(JobLost, match="cannot be recovered"):
            ranks[1][1].resync(2, 0.0)
        said = restarts.read_declaration(str(declared))
        assert said.lost == (JOB, JOB) and said.restartable, said  # both ranks wrote the file
        why = RankRestarts(1, str(tmp_path)).refusal(0)
        assert why is not None and f"found job '{JOB}' lost (JobLost" in why, why
    finally:
        for client, _, _ in ranks:
            client.close()


def test_a_fixed_world_job_that_nothing_holds_is_lost(servers) -> None:
    ranks = both_trained_then_lost([s.address for s in servers(2)], "lost-f", elastic=False)
    try:
        for _, model, _ in ranks:
            model.abandon_step()
            model.restart_collectives(1)
        got = in_threads({r: m.recover for r, (_, m, _) in enumerate(ranks)})
        assert isinstance(got[0][0], JobLost), got
        exc, after = got[1]
        assert isinstance(exc, ShardClientError) and exc.code == grpc.StatusCode.ABORTED, got
        assert "cannot be recovered" in exc.details and after < WAIT_S / 2, got
    finally:
        for client, _, _ in ranks:
            client.close()


def test_a_late_rank_leads_a_round_whose_members_were_all_lost(servers) -> None:
    (node,) = servers(1)
    clients = [
        ShardClient(ClusterSpec([node.address]), rank=r, world_size=2, run_id="late", timeout_s=10)
        for r in range(2)
    ]
    try:
        first, late = (Membership(c, JOB, min_members=1, window_s=0.5, wait_s=8) for c in clients)
        assert first.recovery(1)  # rank 0 alone: it leads (the round waited 0.5 s for rank 1)
        vanish(clients[0])  # and dies before restoring
        began = time.monotonic()
        while True:  # its lease lapses: then the coordinator names rank 1
            try:
                assert late.recovery(1)
                break
            except ShardClientError as exc:  # before: ABORTED after wait_s, not leading
                assert time.monotonic() - began < 60, exc
        assert time.monotonic() - began < 8, "rank 1 waited out wait_s before leading"
    finally:
        for c in clients:
            c.close()
