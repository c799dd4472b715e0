"""Export (docs/design.md §5.1, issue 4): one model.safetensors under the model's own names, from
live servers or offline from a snapshot folder, loadable by ``model.load_state_dict``; streamed
one parameter at a time.

The job is a float64 model trained by one rank on three servers (float64 masters) and is
compared with the same model trained single-process, within 1e-9 (tests/numerics.py); the export
keeps the parameters' dtype, float64.
"""

from __future__ import annotations

import json
import struct
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_ranks
from file_writes import record_writes
from numerics import assert_equivalent
from safetensors import safe_open
from safetensors.torch import load_file
from snapshot_job import (
    CFG,
    STEPS,
    batches,
    initial_weights,
    new_job,
    single_process,
    snapshot_servers,
    train_steps,
    wrap,
)

from paramshard.client import ClusterSpec, ShardClient, tools
from paramshard.models.gpt import GPT
from paramshard.offline_export import export_snapshot
from paramshard.server import ShardServer


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Any:
    """FSDP job trained STEPS steps by one rank on three servers, snapshot 'end' taken."""
    root = tmp_path_factory.mktemp("snaps")
    started: list[ShardServer] = []

    def factory(n: int, **kw: Any) -> list[ShardServer]:
        new = [ShardServer("127.0.0.1", 0, **kw).start() for _ in range(n)]
        started.extend(new)
        return new

    addresses = [s.address for s in snapshot_servers(factory, 3, root)]
    name, init, data = new_job("export"), initial_weights(), batches()

    def rank(client: ShardClient) -> dict:
        model, opt = wrap("fsdp", client, name, init)
        train_steps(model, opt, 0, 1, data, range(STEPS))
        tools.snapshot(client, name, "end")
        return model.state_dict()

    (trained,) = run_ranks(rank, 1, addresses)
    yield {
        "addresses": addresses,
        "job": name,
        "root": root,
        "trained": trained,
        "reference": single_process(),
    }
    for s in started:
        s.stop(0)


def check_against(path: Any, job: dict) -> None:
    loaded = load_file(str(path))
    ref, trained = job["reference"], job["trained"]
    assert set(loaded) == set(ref) == set(GPT(CFG).state_dict())  # lm_head.weight included
    for name, r in ref.items():
        assert loaded[name].dtype == torch.float64, name
        assert loaded[name].shape == r.shape, name
        assert torch.equal(loaded[name], trained[name]), name  # exactly what the servers hold
    assert_equivalent(loaded, ref, "export")
    torch.testing.assert_close(loaded["lm_head.weight"], loaded["wte.weight"], rtol=0, atol=0)
    fresh = GPT(CFG).double()
    fresh.load_state_dict(loaded, strict=True)
    assert fresh.lm_head.weight is fresh.wte.weight  # still tied
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, loaded[name]), name


@pytest.mark.equivalence
def test_export_from_live_servers(job, tmp_path):
    out = tmp_path / "model.safetensors"
    c = ShardClient(ClusterSpec(job["addresses"]), timeout_s=20.0)
    try:
        count = tools.export(c, job["job"], out)
    finally:
        c.close()
    assert count == len(job["reference"])
    check_against(out, job)
    assert not [p for p in tmp_path.iterdir() if p.name != "model.safetensors"]  # no temp file
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["job"] == job["job"]
        assert f.metadata()["version"] == str(STEPS)


@pytest.mark.equivalence
def test_export_offline_from_snapshot(job, tmp_path):
    out = tmp_path / "offline.safetensors"
    count = export_snapshot(job["root"] / job["job"] / "end", out)
    assert count == len(job["reference"])
    check_against(out, job)
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["version"] == str(STEPS) and f.metadata()["tag"] == "end"


def test_offline_export_refuses_a_corrupt_snapshot(job, tmp_path):
    import shutil

    from paramshard.cli import CommandError

    folder = tmp_path / "snaps" / job["job"] / "bad"
    shutil.copytree(job["root"] / job["job"] / "end", folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "tag": "bad"}))  # valid
    shard = folder / "shard-2-of-3.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x01
    shard.write_bytes(bytes(raw))
    out = tmp_path / "x.safetensors"
    with pytest.raises(CommandError, match=str(shard)):
        export_snapshot(folder, out)
    assert not out.exists()


# -- write_safetensors ---------------------------------------------------------------------------
def test_write_safetensors_dtypes_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 1e-8, np.inf, -np.inf], dtype=np.float32)
    values = {
        "a32": rng.standard_normal((3, 5)).astype(np.float32),
        "b16": rng.standard_normal(7).astype(np.float32),
        "cbf": rng.standard_normal((2, 2, 3)).astype(np.float32) * 100,
        "d64": rng.standard_normal(4).astype(np.float32),
        "s16": special,
        "sbf": special,
        "empty": np.zeros((0, 3), dtype=np.float32),
        "scalar": np.array(3.25, dtype=np.float32),
    }
    dtypes = {
        "a32": "float32",
        "b16": "float16",
        "cbf": "bfloat16",
        "d64": "float64",
        "s16": "float16",
        "sbf": "bfloat16",
        "empty": "float32",
        "scalar": "float32",
    }
    path = tmp_path / "t.safetensors"
    tools.write_safetensors(
        path,
        [(k, dtypes[k], v.shape, lambda v=v: v.reshape(-1)) for k, v in values.items()],
        {"k": "v"},
    )
    loaded = load_file(str(path))
    torch_dtype = {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float64": torch.float64,
    }
    assert list(loaded) == sorted(values) or set(loaded) == set(values)
    for k, v in values.items():
        want = torch.from_numpy(v.copy()).to(torch_dtype[dtypes[k]])
        assert loaded[k].dtype == want.dtype and loaded[k].shape == want.shape, k
        assert torch.equal(loaded[k], want), k
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"k": "v"}
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]


def test_write_safetensors_streams_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The header goes out first; then each producer is asked once, in order, and its bytes
    written before the next is asked; arrays two items back are no longer referenced."""
    events: list[tuple] = []
    produced: list[weakref.ref] = []
    record_writes(monkeypatch, lambda data: events.append(("write", len(data))))

    def producer(i: int) -> Any:
        def produce() -> np.ndarray:
            alive = [j for j, ref in enumerate(produced[:-1]) if ref() is not None]
            assert not alive, f"producing {i}: arrays {alive} are still held"
            events.append(("produce", i))
            arr = np.full(1000, float(i), dtype=np.float32)
            produced.append(weakref.ref(arr))
            return arr

        return produce

    n = 6
    path = tmp_path / "s.safetensors"
    tools.write_safetensors(path, [(f"t{i}", "float32", (1000,), producer(i)) for i in range(n)])
    # 8-byte length, header, then produce/write pairs
    assert events[0] == ("write", 8)
    assert events[1][0] == "write"
    (head_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert events[1][1] == head_len
    rest = events[2:]
    assert [e for e in rest if e[0] == "produce"] == [("produce", i) for i in range(n)]
    for i in range(n):
        assert rest[2 * i] == ("produce", i) and rest[2 * i + 1] == ("write", 4000), rest
    header = json.loads(path.read_bytes()[8 : 8 + head_len])
    assert [header[f"t{i}"]["data_offsets"] for i in range(n)] == [
        [4000 * i, 4000 * (i + 1)] for i in range(n)
    ]
    loaded = load_file(str(path))
    for i in range(n):
        assert torch.equal(loaded[f"t{i}"], torch.full((1000,), float(i)))
