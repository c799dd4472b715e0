"""A snapshot restored for another number of data-parallel ranks: ``paramshard restore
--contributors N`` (client/checkpoints.py ``restore``). A restore keeps the snapshot's ranks
otherwise, and ranks of another count are refused when they register; the refusal says which
restore they needed (server/buffers/store.py), where only ``--help`` said it before.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient, ShardClientError, tools
from paramshard.server import ShardServer

N = 64


def test_a_restore_for_another_rank_count_is_named_by_the_refusal(tmp_path):
    server = ShardServer("127.0.0.1", 0, snapshot_dir=str(tmp_path)).start()
    job = f"ranks-{uuid.uuid4().hex[:6]}"

    def client(world: int) -> ShardClient:
        spec = ClusterSpec([server.address])
        return ShardClient(spec, rank=0, world_size=world, run_id=uuid.uuid4().hex[:6])

    two, tool = client(2), ShardClient(ClusterSpec([server.address]))
    three = None
    try:
        two.register_buffer(job, "w", N, contributors=2)
        two.set_params(job, "w", np.arange(N, dtype=np.float32))
        tools.snapshot(tool, job, "two")
        two.close()  # the run ended; the job stays on the server
        tools.restore(tool, job, "two")  # as taken: 2 ranks
        three = client(3)
        with pytest.raises(ShardClientError, match="another layout") as err:
            three.register_buffer(job, "w", N, contributors=3)
        assert "contributors (data-parallel ranks) 2 here, 3 asked" in err.value.details
        assert "paramshard restore JOB --tag TAG --contributors N" in err.value.details
        three.close()
        tools.restore(tool, job, "two", 3)  # for 3 ranks: they register
        three = client(3)
        three.register_buffer(job, "w", N, contributors=3)
        assert np.array_equal(three.pull_params(job, "w", N), np.arange(N, dtype=np.float32))
    finally:
        for c in (two, three, tool):
            if c is not None:
                c.close()
        server.stop(0)
