"""What a person sees of an elastic job: ``paramshard status``'s elastic section (members, joins,
leaves, steps at each world size, the newest events) and the coordinator's metrics.

Ranks here are ``Membership`` objects (client/membership.py) on one real server, so the rounds
are the protocol's own without training anything: three ranks train step 0, rank 2 leaves,
rank 3 joins at step 1.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from test_metrics import scrape

from paramshard import cli
from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.membership import Membership
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer


def rounds(address: str) -> None:
    clients = [
        ShardClient(ClusterSpec([address]), rank=r, world_size=4, run_id="seen", timeout_s=10)
        for r in range(4)
    ]
    try:
        for c in clients:
            c.register_buffer("watched", "b", 8, optimizer="sgd", hyper={"lr": 0.1}, contributors=4)
        clients[0].set_params("watched", "b", np.zeros(8, np.float32), version=0)
        ranks = [Membership(c, "watched", min_members=1, window_s=0.5, wait_s=30) for c in clients]
        threads = [threading.Thread(target=ranks[r].join, args=(0,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        ranks[2].leave("done early")
        clients[0].set_params("watched", "b", np.zeros(8, np.float32), version=1)  # step 0 done
        threads = [threading.Thread(target=ranks[r].join, args=(1,)) for r in (3, 0, 1)]
        threads[0].start()  # rank 3 first: it waits for the ranks of step 0, which take it in
        while 3 not in clients[0].status()[0]["memberships"][0].get("waiting", []):
            time.sleep(0.02)
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for c in clients:
            c.close()


def test_status_shows_members_history_and_steps_by_world_size(capsys) -> None:  # noqa: ANN001
    with ShardServer(metrics_port=0) as server:
        rounds(server.address)
        assert cli.main(["status", "--servers", server.address]) == 0
        text = capsys.readouterr().out
        metrics = scrape(server.metrics_url)
        (row,) = ShardClient(ClusterSpec([server.address])).status()[0]["memberships"]
    assert "Elastic jobs (membership agreed on each job's server 0):" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("watched"))
    assert line.split()[:9] == ["watched", "seen", "1", "0", "0-1,", "3", "1", "4", "1"], line
    assert "3: 2" in line  # two steps of three ranks
    assert "step 0: rank 2 join" in text and "step 1: rank 2 leave" in text
    assert "step 1: rank 3 join" in text
    assert [(e["kind"], e["rank"]) for e in row["history"]][3:] == [("join", 3), ("leave", 2)]
    assert metrics[("paramshard_elastic_members", (("job", "watched"),))] == 3
    assert metrics[("paramshard_elastic_joins_total", (("job", "watched"),))] == 4
    assert metrics[("paramshard_elastic_leaves_total", (("job", "watched"),))] == 1
    steps = ("paramshard_elastic_steps_total", (("job", "watched"), ("world_size", "3")))
    assert metrics[steps] == 2


def test_join_needs_the_train_role() -> None:
    with ShardServer(tokens={"r": "read", "t": "train"}) as server:
        request = pb.JoinRequest(
            run="r", job="j", rank=0, world_size=1, min_members=1, known_members=[0]
        )
        reader = ShardClient(ClusterSpec([server.address], token="r"), timeout_s=5)
        trainer = ShardClient(ClusterSpec([server.address], token="t"), timeout_s=5)
        try:
            with pytest.raises(Exception, match="PERMISSION_DENIED"):
                reader.call(0, "Join", request)
            assert trainer.call(0, "Join", request).member
        finally:
            reader.close()
            trainer.close()
