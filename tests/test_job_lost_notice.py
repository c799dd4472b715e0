"""A rank that finds its job lost (``JobLost``: no server, replica or snapshot holds it) tells
the others with a final notice, and they stop instead of recovering again.

Found by a hostile review: rank 0 raised JobLost and posted "gives up", but the notice was an
ordinary one, so rank 1 took it for a recoverable failure and started three more recovery
epochs, each waiting 59 s for rank 0 in its first all-reduce, and failed after 183-186 s with
DEADLINE_EXCEEDED naming a server. Now the notice is final (``LeaseRequest.final``): it holds
at every epoch, and ``train_with_recovery`` raises it at once.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from conftest import unique_id
from lease_fakes import KILL_NOTICE_S, Stream, keep, lease, new_table

from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.strategies.recovery import _recoverable

pytestmark = pytest.mark.timeout(120)


def test_a_final_abort_holds_at_every_epoch_and_nothing_replaces_it() -> None:
    leases, clock = new_table()
    watching = Stream(rank=1)
    leases.open_hold(lease(1), watching)
    leases.renew(lease(0, abort="gives up: job 'j' cannot be recovered", final=True))
    assert watching.pushed[-1].final and "gives up" in watching.pushed[-1].aborted
    for epoch in (0, 1, 7):  # the others' next epochs too
        reply = leases.renew(lease(1, epoch=epoch))
        assert reply.final and "rank 0 gives up" in reply.aborted, epoch
    leases.renew(lease(1, epoch=3, abort="recovers: server 1 lost"))  # a later, lesser one
    reply = keep(leases, clock, 0.1, 1)
    assert reply.final and "rank 0 gives up" in reply.aborted


def test_the_other_ranks_stop_instead_of_recovering(servers) -> None:
    (srv,) = servers(1)
    run = unique_id()
    spec = ClusterSpec([srv.address])
    ranks = [ShardClient(spec, rank=r, world_size=2, run_id=run, timeout_s=20) for r in (0, 1)]
    try:
        with ThreadPoolExecutor(2) as pool:  # both met: their leases and streams are up
            list(pool.map(lambda r: r.all_reduce(np.ones(3, np.float32)), ranks))
        began = time.monotonic()
        ranks[0].run_state.give_up("gives up: job 'j' cannot be recovered", final=True)
        other = ranks[1].run_state
        while other.current() is None and time.monotonic() - began < KILL_NOTICE_S:
            time.sleep(0.05)
        notice = other.current()
        assert notice is not None and notice.final, notice
        assert "rank 0 gives up: job 'j' cannot be recovered" in notice.reason
        ranks[1].restart_collectives(5)  # a recovery's next epoch: the notice holds there too
        assert other.current() is notice
        model = SimpleNamespace(client=ranks[1], elastic=False)
        aborted = ShardClientError(0, srv.address, "ReadSlot", grpc.StatusCode.ABORTED, "x")
        assert not _recoverable(model, aborted)  # before: True, and rank 1 recovered again
        assert not _recoverable(SimpleNamespace(client=ranks[1], elastic=True), aborted)
    finally:
        for r in ranks:
            r.close()
