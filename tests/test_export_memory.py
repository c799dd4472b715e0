"""Export holds about one tensor (client/export.py, client/jobs.py ``pull_param``).

A CLI export of GPT-2 124M peaked at 3.5 times its largest tensor: the writer converted each
tensor (``astype``, a copy even where the dtype matched) and then copied it again into bytes
(``tobytes``); and a pull's ``run`` kept every in-band reply, a second copy of the tensor,
until its last chunk came. The writer now writes the produced array's own memory, and pulls
run ``max_in_flight`` chunks at a time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from file_writes import record_writes
from safetensors.torch import load_file
from snapshot_job import one_rank

from paramshard.client import ClusterSpec, ShardClient, jobs, tools
from paramshard.server import ShardServer


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_write_safetensors_writes_the_arrays_own_memory(tmp_path, monkeypatch, dtype):
    """What is written of a tensor already in the file's dtype is a view of the produced array,
    not a converted copy nor a bytes copy of it."""
    arrays = [np.arange(1000, dtype=dtype) * 0.5, np.full(7, 3.0, dtype=dtype)]
    written: list[Any] = []
    record_writes(monkeypatch, written.append)
    name = "float32" if dtype == np.float32 else "float64"
    path = tmp_path / "t.safetensors"
    items = [(f"t{i}", name, a.shape, lambda a=a: a) for i, a in enumerate(arrays)]
    tools.write_safetensors(path, items)
    tensors = written[2:]  # after the length and the header
    assert len(tensors) == len(arrays)
    for data, a in zip(tensors, arrays, strict=True):
        assert isinstance(data, memoryview), type(data)
        assert np.shares_memory(np.frombuffer(data, dtype=dtype), a), "a copy was written"
    loaded = load_file(str(path))
    for i, a in enumerate(arrays):
        assert torch.equal(loaded[f"t{i}"], torch.from_numpy(a))


def test_a_pull_runs_at_most_max_in_flight_chunks_at_once(monkeypatch):
    """One ``run`` keeps every reply until it returns: a tensor of many chunks is pulled in
    runs of ``max_in_flight`` calls, each run's replies freed before the next."""
    started = [ShardServer("127.0.0.1", 0).start() for _ in range(2)]
    addresses = [s.address for s in started]
    job, trainer, *_ = one_rank(addresses, 1)
    client = ShardClient(ClusterSpec(addresses), timeout_s=20.0, chunk_bytes=256, max_in_flight=2)
    try:
        ref = max(tools.job_params(client, job), key=lambda r: r.numel)
        want = jobs.pull_param(client, job, ref)
        runs: list[int] = []
        real = client.run

        def run(calls: Any) -> list[Any]:
            calls = list(calls)
            runs.append(len(calls))
            return real(calls)

        monkeypatch.setattr(client, "run", run)
        versions: list[int] = []
        got = jobs.pull_param(client, job, ref, versions)
        assert np.array_equal(got, want)
        assert sum(runs) == len(versions) > 4 * 2  # many chunks, every one's version seen
        assert max(runs) <= 2, runs
        assert set(versions) == {1}
    finally:
        client.close()
        trainer.close()
        for s in started:
            s.stop(0)
