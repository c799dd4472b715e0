"""A server that restarts, empty, within the grace its renewals get: a rank in
``train_with_recovery`` (``RunState.fail_fast``) learns it from the lease's next answer, which
comes from another process (``LeaseReply.incarnation``), gives up its epoch, and every rank
recovers at once (client/server_loss.py). Before, a rank waiting on another server's call met
the restart only when that call ended: in a node down under ``paramshard launch`` (ZeRO-2: rank
0 in its GradNorm on server 0, waiting for the dead rank 1's gradient), 120 s later, blaming
server 0 (a field run).

Real in-process servers on 127.0.0.1, server 1 stopped and another started at its port; the
renewals' own grace (``STREAM_GRACE_S``) made longer than the test, so only the restart can
tell. Every wait is bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from conftest import port_to_reuse

from paramshard.client import ClusterSpec, ShardClient, server_loss
from paramshard.client.run_state import Notice
from paramshard.server import ShardServer

pytestmark = pytest.mark.timeout(120)
RESTARTED = "lost: it restarted, empty (another process answers)"


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list, list[ShardClient]]]:
    monkeypatch.setattr(server_loss, "STREAM_GRACE_S", 600.0)  # no "unreachable" in the test
    port = port_to_reuse()
    servers = [ShardServer(local_calls=False).start(), ShardServer(port=port).start()]
    addresses = [s.address for s in servers]
    clients = [
        ShardClient(ClusterSpec(addresses), rank=r, world_size=2, run_id="again", timeout_s=10)
        for r in range(2)
    ]
    clients[0].run_state.fail_fast = True  # rank 0 is in train_with_recovery
    try:
        yield servers, clients
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.stop(0)


def restart_server_1(servers: list, between: Callable[[], None] = lambda: None) -> None:
    """Stops server 1, runs ``between``, starts another at its port."""
    port = int(servers[1].address.rsplit(":", 1)[1])
    servers[1].stop(0)
    between()
    servers[1] = ShardServer(port=port).start()


def notice_within(client: ShardClient, seconds: float) -> Notice | None:
    deadline = time.monotonic() + seconds
    while (notice := client.run_state.current()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return notice


def test_a_restarted_server_ends_the_epoch_of_every_rank(two_ranks) -> None:
    servers, clients = two_ranks
    assert notice_within(clients[0], 2.5) is None  # renewals answered by the same processes
    restart_server_1(servers)
    notice = notice_within(clients[0], 10)
    assert notice is not None and RESTARTED in notice.reason, notice
    assert f"rank 0 recovers: server 1 ({servers[1].address})" in notice.reason
    seen = notice_within(clients[1], 10)  # through the servers: every rank recovers
    assert seen is not None and RESTARTED in seen.reason, seen


def test_a_restart_before_the_epoch_began_is_its_recovery_s_own(two_ranks) -> None:
    """A recovery moves every rank to a new epoch before the server it restores answers
    again: that restart is what the recovery is for, not a new loss. A restart within the
    new epoch is one."""
    servers, clients = two_ranks
    notice_within(clients[0], 2.5)  # each rank has had renewals answered by server 1

    def recovery_begins() -> None:  # as train_with_recovery does, then waits for the servers
        for c in clients:
            c.restart_collectives(1)

    restart_server_1(servers, recovery_begins)
    assert notice_within(clients[0], 4) is None
    restart_server_1(servers)
    notice = notice_within(clients[0], 10)
    assert notice is not None and RESTARTED in notice.reason and notice.epoch == 1, notice
