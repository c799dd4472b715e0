"""Which run a job's collectives are in when nothing names one (client/run_id.py).

Two jobs on the same servers whose environment named no run (no PARAMSHARD_RUN, torchrun's
static ``--rdzv-id`` default) both used to be in run "run": their all-reduces met in the same
slots, and the ranks that came first went on with sums mixing both jobs' values while the
others failed on slots already freed. A strategy's configuration now takes its job's run.

A job run again under a fixed run id (torchrun's ``--rdzv-id``, PARAMSHARD_RUN) on the same
servers failed at its first broadcast: the servers remembered the first run's keys as freed.
A run whose ranks all released their leases is now forgotten with its keys
(``SlotStore.forget_run``), and the next one starts clean."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import unique_id, worker_env
from lease_fakes import Stream, contribute, new_table

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.run_id import job_run_id
from paramshard.protos import closing
from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.gone_keys import (
    ENTRY_BYTES,
    FORGET_AFTER,
    FORGET_BYTES,
    GoneKeys,
)
from paramshard.server.collectives.leases import LeaseTable
from paramshard.server.collectives.slots import SlotStore
from paramshard.server.runtime.errors import ShardError
from paramshard.strategies import ShardingConfiguration

_RANK = textwrap.dedent(
    """
    import os
    import numpy as np
    from paramshard.strategies import ShardingConfiguration

    config = ShardingConfiguration.from_env(job=os.environ["JOB"])
    c = config.client
    scale = 100.0 if os.environ["JOB"] == "b" else 1.0
    sums = {float(c.all_reduce(np.full(4, scale * (c.rank + 1), np.float32))[0]) for _ in range(20)}
    print(c.run_id, *sorted(sums), flush=True)
    c.close()
    """
)


def _unnamed(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PARAMSHARD_RUN", "TORCHELASTIC_RUN_ID", "PARAMSHARD_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def test_a_configuration_from_the_environment_takes_its_jobs_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _unnamed(monkeypatch)
    monkeypatch.setenv("PARAMSHARD_SERVERS", "127.0.0.1:1")  # a single rank: no RPC is made
    config = ShardingConfiguration.from_env(job="team-a")
    assert config.client.run_id == job_run_id("team-a") == "team-a"  # a job scope covers it
    config.client.close()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's static default names none
    config = ShardingConfiguration.from_env(job="team-a.e5")  # not read as a restart's epoch
    assert config.client.run_id == "team-a.e5-run"
    config.client.close()
    monkeypatch.setenv("PARAMSHARD_RUN", "named")  # a named run wins
    config = ShardingConfiguration.from_env(job="team-a")
    assert config.client.run_id == "named"
    config.client.close()


def test_two_jobs_without_a_run_id_keep_their_sums_apart(
    servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs of two ranks each on the same two servers at once, no run named: every
    all-reduce of each job is its own ranks' sum (job a: 1 + 2, job b: 100 + 200)."""
    _unnamed(monkeypatch)
    nodes = servers(2)
    env = {**worker_env(), "PARAMSHARD_SERVERS": ",".join(n.address for n in nodes)}
    env = {**env, "WORLD_SIZE": "2", "GRPC_VERBOSITY": "ERROR"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK],
            env={**env, "JOB": job, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for job in ("a", "b")
        for rank in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(ranks, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    got = [out.split() for out, _ in outs]
    assert got == [["a", "3.0"]] * 2 + [["b", "300.0"]] * 2, got


def _job(addresses: list[str], run: str, scale: float) -> list[list[float]]:
    """A two-rank job on ``addresses`` under run ``run``: a broadcast from rank 0, then an
    all-reduce; each rank's two results, and its client closed (its lease released)."""
    spec = ClusterSpec(addresses)

    def rank(r: int) -> list[float]:
        c = ShardClient(spec, rank=r, world_size=2, run_id=run)
        try:
            first = c.broadcast(np.full(4, scale * 7.0), src=0)
            total = c.all_reduce(np.full(4, scale * (r + 1)))
            return [float(first[0]), float(total[0])]
        finally:
            c.close()

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(rank, (0, 1)))


def test_a_job_run_again_under_its_run_id_starts_clean(servers) -> None:
    """Run the same job again on the same servers with a fixed run id (torchrun's --rdzv-id,
    PARAMSHARD_RUN): its collectives count from 1 again. The servers used to remember the first
    run's keys as freed, so the second run's first broadcast failed with NOT_FOUND; now the
    servers forget a run whose ranks all released their leases."""
    addresses = [n.address for n in servers(2)]
    run = unique_id("again")
    assert _job(addresses, run, 1.0) == [[7.0, 3.0]] * 2
    assert _job(addresses, run, 10.0) == [[70.0, 30.0]] * 2
    assert _job(addresses, run, 100.0) == [[700.0, 300.0]] * 2


def test_a_rank_that_comes_after_its_peer_left_is_in_the_same_run(servers) -> None:
    """Rank 0 broadcasts and closes its client before rank 1 exists: only one rank of two
    released, so the run goes on, and rank 1 reads what rank 0 sent."""
    addresses = [n.address for n in servers(1)]
    spec, run = ClusterSpec(addresses), unique_id("late")
    first = ShardClient(spec, rank=0, world_size=2, run_id=run)
    first.broadcast(np.full(3, 5.0), src=0)
    first.close()
    late = ShardClient(spec, rank=1, world_size=2, run_id=run)
    try:
        assert np.array_equal(late.broadcast(np.zeros(3), src=0), np.full(3, 5.0))
    finally:
        late.close()


def test_a_forgotten_run_leaves_no_key_behind_and_touches_no_other_run() -> None:
    store = SlotStore()

    def add(key: str, contributor: int = 0, expected: int = 1) -> bool:
        return contribute(store, key, contributor, expected)

    def read(key: str) -> None:
        store.read(pb.ReadSlotRequest(key=key, offset=0, reader=0), timeout=1.0)

    add("r:ar1/0")
    read("r:ar1/0")  # freed: a contribution now reads as a late retry
    assert add("r:ar1/0") is True
    add("r:ar2/0", expected=2)  # ended by the abort below
    store.abort_run("r", 0, "rank 1 lost")
    with pytest.raises(ShardError):  # a key of the aborted epoch is refused
        add("r:ar3/0", expected=2)
    add("r.e1/tp:ar2/0", expected=2)  # left open by the run's next epoch, in a group
    add("r2:ar1/0", expected=2)  # another run whose id starts with this one's
    assert store.forget_run("r") == 1  # the open slot of r's group
    for key in ("r:ar1/0", "r:ar2/0", "r:ar3/0", "r.e1/tp:ar2/0"):  # each a new slot now
        assert add(key, expected=2) is False, key
    assert add("r2:ar1/0", contributor=1, expected=2) is False  # r2's slot was kept, open
    read("r2:ar1/0")


def test_the_books_of_gone_keys_stay_bounded_and_find_a_run_by_its_keys() -> None:
    gone = GoneKeys()
    for i in range(FORGET_AFTER + 10):  # the oldest ten go, from the index too
        gone.note_freed(f"r{i % 3}:ar{i}/0", (i, 0))
    assert len(gone.freed) == FORGET_AFTER and "r0:ar0/0" not in gone.freed
    gone.note_ended("r1.e2/tp:ar1/0", "expired")
    gone.forget_run("r1")
    assert not [k for k in (*gone.freed, *gone.ended) if k.startswith("r1")]
    assert len(gone.freed) == sum(i % 3 != 1 for i in range(10, FORGET_AFTER + 10))
    gone.forget_run("r")  # no run "r": the others stay
    assert len(gone.freed) > FORGET_AFTER // 2


def test_an_aborted_run_refuses_its_keys_and_no_other_runs() -> None:
    """A new key is refused when its run's epoch was aborted. The runs it may belong to are
    now looked up from its head, not walked (a review: every new key of every team tried each
    aborted run under the store's lock); the answers are the walk's, for runs whose ids start
    with each other's, groups, epochs, and a key longer than any run id."""
    from paramshard.server.collectives.pending import run_epoch

    aborted = {"r": (1, "r lost"), "r.eval": (0, "eval lost"), "t/x": (0, "t/x lost")}
    gone = GoneKeys()
    for run, (epoch, why) in aborted.items():
        gone.abort(run, epoch, why)
    keys = ["r:ar1/0", "r.e1:ar/0", "r.e2:ar/0", "r.e1/tp:ag/0", "r/g0.e2:x", "r2:ar/0",
            "r.eval:ar/0", "r.eval.e1:ar/0", "t/x:ar/0", "t:ar/0", "q:" + "r" * 900,
            "r." + "e" * 300 + ":x", "r/" + "a/" * 200 + ":x"]  # fmt: skip

    def walked(key: str) -> str | None:
        for run, (epoch, why) in aborted.items():
            if (e := run_epoch(key, run)) is not None and e <= epoch:
                return f"slot '{key}': {why}"
        return None

    answers = {key: gone.aborted(key) for key in keys}
    assert answers == {key: walked(key) for key in keys}
    assert answers["r.e1:ar/0"] == "slot 'r.e1:ar/0': r lost" and answers["r.e2:ar/0"] is None
    assert answers["r2:ar/0"] is None and answers["r/" + "a/" * 200 + ":x"] is not None


def test_the_books_of_gone_keys_are_bounded_in_bytes_too() -> None:
    """Found in review: 66,000 keys of 1,024 characters, freed, and 75,000 ended, grew a
    server by 507 MiB outside its account (the books counted entries). Each book now keeps
    at most ``FORGET_BYTES`` of keys and reasons, the oldest forgotten first."""
    gone = GoneKeys()
    long = "x" * 1000
    for i in range(40_000):
        gone.note_freed(f"r:{long}{i}", (i, 0))
        gone.note_ended(f"r:{long}{i}", f"slot 'r:{long}{i}' expired")
    for book in (gone._freed, gone._ended):
        assert book.bytes <= FORGET_BYTES
        assert book.bytes == sum(ENTRY_BYTES + 2 * len(k) + len(v if isinstance(v, str) else "")
                                 for k, v in book.items.items())  # fmt: skip
    assert len(gone.freed) < 40_000 and f"r:{long}39999" in gone.freed  # the newest stay
    gone.forget_run("r")
    assert gone._freed.bytes == gone._ended.bytes == 0 and not gone.freed


def test_a_run_whose_ranks_left_is_forgotten_once_nothing_of_it_waits() -> None:
    """An elastic job of at most three ranks ran with two: its run is over when both released
    and no slot of it is open, and runs again clean; a rank that comes after its peer left to
    read what the peer sent still finds it."""
    leases, _ = new_table()

    def lease_(rank: int, **kw) -> pb.LeaseRequest:
        return pb.LeaseRequest(run="e", rank=rank, world_size=3, ttl_ms=2000, holder="h", **kw)

    def read(key: str, reader: int) -> None:
        leases.slots.read(pb.ReadSlotRequest(key=key, offset=0, reader=reader), timeout=1.0)

    leases.renew(lease_(0))
    contribute(leases.slots, "e:bc1/0", 0, expected=1, readers=1)  # sent, not read yet
    leases.renew(lease_(0, release=True))
    leases.renew(lease_(1))  # late: the run is still there, and so is what rank 0 sent
    assert [x.key for x in leases.slots.open_slots()] == ["e:bc1/0"]
    read("e:bc1/0", 1)
    leases.renew(lease_(1, release=True))
    assert contribute(leases.slots, "e:bc1/0", 0, expected=1) is True  # a late retry now
    leases.renew(lease_(0))  # the job again: two of three released, nothing open
    assert contribute(leases.slots, "e:bc1/0", 0, expected=1) is False  # a new slot


def _client_lease(rank: int, client: int, **kw) -> pb.LeaseRequest:
    """A request of client ``client`` of process "p" for rank ``rank`` of run "j"."""
    return pb.LeaseRequest(
        run="j", rank=rank, world_size=2, ttl_ms=2000, holder="p", client=client, **kw
    )


def test_a_closed_clients_late_release_drops_nothing_of_the_next_clients_lease() -> None:
    """One process runs a two-rank job twice under one run id (a script's loop, a notebook).
    On a loaded machine the first job's releases reached the server after the second job's
    clients leased the same ranks: same process, so nothing refused them, and they dropped the
    new leases and counted as the ranks' releases; the next renewal then found the run ended
    and dropped the second job's open slots (its all-reduce waited for a part that was gone).
    A release now drops only the lease of the client that sent it."""
    leases, _ = new_table()

    for rank in (0, 1):
        leases.renew(_client_lease(rank, client=1 + rank))  # the first job's clients
    for rank in (0, 1):
        leases.renew(_client_lease(rank, client=3 + rank))  # the second job, not yet released
    assert contribute(leases.slots, "j:ar1/0", 0) is False  # rank 0's part of its all-reduce
    for rank in (0, 1):
        leases.renew(_client_lease(rank, client=1 + rank, release=True))  # the first job's, late
    run = leases._runs["j"]
    assert sorted(run.leases) == [0, 1] and not run.released
    assert [run.leases[r].client for r in (0, 1)] == [3, 4]
    leases.renew(_client_lease(1, client=4))
    assert [x.key for x in leases.slots.open_slots()] == ["j:ar1/0"]
    assert contribute(leases.slots, "j:ar1/0", 1) is False  # rank 1's part: the same sum
    for rank in (0, 1):
        leases.renew(_client_lease(rank, client=3 + rank, release=True))  # the second job's own
    assert not leases._runs["j"].leases and leases._runs["j"].released == {0, 1}


def test_a_released_leases_stream_that_ends_late_leaves_the_next_clients_lease_held() -> None:
    """Rank 0's process closes its client and makes another for the same rank of the same run
    while rank 1 trains on. The old client's stream ended on the server only after the new
    one's opened: it used to count against the new lease, which then read as closed and
    lapsed UNSEEN_END_S later under a live rank that held it by its stream (an abort). A
    release now takes its streams' count with it."""
    leases, clock = new_table()

    old, new = Stream(run="j", rank=0), Stream(run="j", rank=0)
    leases.open_hold(_client_lease(0, client=1), old)
    leases.renew(_client_lease(1, client=2))
    leases.renew(_client_lease(0, client=1, release=True))  # in time; its stream ends later
    leases.open_hold(_client_lease(0, client=3), new)
    assert not leases.end_hold(old)  # nothing to decide: it held the released lease
    assert leases._runs["j"].leases[0].holds == 1
    for _ in range(10):  # rank 0 holds by its stream and renews; rank 1 renews
        clock.now += 1.0
        assert leases.renew(_client_lease(0, client=3, stream=True)).aborted == ""
        assert leases.renew(_client_lease(1, client=2)).aborted == ""
    assert not new.pushed and leases.live_ranks("j") == {0, 1}


def test_releases_answered_late_are_sent_again_before_the_next_run_leases(
    servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The servers answer every client's first release only after its close gave up waiting
    (a loaded machine): the job run again in the same process must still find the last run
    ended. The next client sends the unanswered releases of the run again and waits for their
    answers before it leases; the first copies, when they come, drop nothing."""
    addresses = [n.address for n in servers(2)]
    run = unique_id("slow-release")
    real, seen, late = LeaseTable.renew, set(), []

    def renew(self: LeaseTable, req: pb.LeaseRequest, owner: str | None = None):
        if req.release and req.run == run and (id(self), req.client) not in seen:
            seen.add((id(self), req.client))
            time.sleep(2 * closing.STEP_S)  # past the client's wait and the call's deadline
            late.append(req.client)
        return real(self, req, owner)

    monkeypatch.setattr(LeaseTable, "renew", renew)
    assert _job(addresses, run, 1.0) == [[7.0, 3.0]] * 2
    assert _job(addresses, run, 10.0) == [[70.0, 30.0]] * 2
    assert _job(addresses, run, 100.0) == [[700.0, 300.0]] * 2
    assert len(late) >= 8  # both servers held back the first two runs' four releases


def test_a_released_clients_late_renewal_and_stream_hold_nothing() -> None:
    """A renewal or stream that a client sent just before its release, and that reached the
    server after it, used to lease the rank again for a whole TTL: the ended run then stayed
    (the next run under its id met its keys), or the stream, closed a moment later, lapsed
    under a run that went on. Now they hold nothing, and the next run starts clean."""
    leases, _ = new_table()

    for rank in (0, 1):
        leases.renew(_client_lease(rank, client=1 + rank))
    contribute(leases.slots, "j:ar1/0", 0, expected=1, readers=1)
    leases.slots.read(pb.ReadSlotRequest(key="j:ar1/0", offset=0, reader=0), timeout=1.0)
    for rank in (0, 1):
        leases.renew(_client_lease(rank, client=1 + rank, release=True))
    leases.renew(_client_lease(1, client=2, stream=True))  # rank 1's last renewal, late
    with pytest.raises(ShardError) as refused:
        leases.open_hold(_client_lease(0, client=1), Stream(run="j", rank=0))  # rank 0's, late
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert not leases._runs["j"].leases
    leases.renew(_client_lease(0, client=3))  # the job again: the last run ended, its keys went
    assert contribute(leases.slots, "j:ar1/0", 0, expected=1) is False  # a new slot


def test_an_ends_release_after_the_clients_release_counts() -> None:
    """A client that closed before its process's exit (a ``finally``) says at the exit that
    its rank ended for good, in a second release from the same client (client/leases.py,
    ``_end_closed``). Unlike a renewal come late, it counts: the server records the end, which
    fails its peers' waits at once. The server exempts it by name, as it exempts an abort;
    before, only the client 0 it is sent as (for older servers) passed the late check."""
    leases, _ = new_table()
    for rank in (0, 1):
        leases.renew(_client_lease(rank, client=1 + rank))
    leases.renew(_client_lease(1, client=2, release=True))
    leases.renew(_client_lease(1, client=2))  # a renewal of the closed client, late
    assert 1 not in leases._runs["j"].leases
    assert leases.ended("j", [1]) == ""  # released, not ended: it may lease again
    leases.renew(_client_lease(1, client=2, release=True, ends=True))  # at its exit
    assert leases.ended("j", [1]).startswith("missing rank(s) 1 ended:"), leases.ended("j", [1])
    assert 1 not in leases._runs["j"].leases
