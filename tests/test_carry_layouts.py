"""A data-parallel job's snapshot loaded by a 3D model of the same job name, and a 3D job's by a
data-parallel model (``load_checkpoint``; client/carry.py), as torchtitan users move a run from
FSDP to FSDP + TP + PP and back: the parameters come back bitwise, and the steps after the load
reach the parameters the run that took the snapshot reached (float64: 1e-9; the layouts sum
in other orders), which needs Adam's moments and step count carried too. Ranks are threads,
as in tests/hybrid_runs.py, whose float64 GPT, batches and optimizer both sides use.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hybrid_runs import (
    AGAIN,
    BATCH,
    FIRST,
    adamw,
    batches,
    initial_weights,
    new_gpt,
    run_hybrid,
    sgd,
)

from paramshard.cli import main
from paramshard.client import ClusterSpec, ShardClient, tools
from paramshard.client.jobs import server_jobs
from paramshard.models.gpt import Block
from paramshard.server import ShardServer
from paramshard.strategies import FSDPModel, FSDPOptimizer, ShardingConfiguration

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.timeout(600),
    pytest.mark.equivalence,
]

DP = 2


def run_fsdp(addresses: list[str], job: str, body: Any) -> list:
    """``body(model, train)`` on DP FSDP ranks as threads; ``train(s)`` as in run_hybrid."""
    run, data, init = uuid.uuid4().hex[:6], batches(FIRST + AGAIN), initial_weights()

    def rank(r: int) -> Any:
        client = ShardClient(ClusterSpec(addresses), rank=r, world_size=DP, run_id=run)
        try:
            config = ShardingConfiguration(client, job=job)
            net = new_gpt()
            net.load_state_dict(init)
            model = FSDPModel(net, config, wrap=(Block,))
            FSDPOptimizer(adamw(model.parameters()), config)
            per = BATCH // DP

            def train(s: int) -> float:
                part = data[s, r * per : (r + 1) * per]
                return model.train_on_batch(part[:, :-1], part[:, 1:])

            return body(model, train)
        finally:
            client.close()

    with ThreadPoolExecutor(DP) as pool:
        return [f.result(timeout=300) for f in [pool.submit(rank, r) for r in range(DP)]]


def save_and_go_on(model: Any, train: Any) -> dict[str, Any]:
    for s in range(FIRST):
        train(s)
    version = model.save_checkpoint("taken")
    taken = model.state_dict()
    for s in range(FIRST, FIRST + AGAIN):
        train(s)
    return {"version": version, "taken": taken, "after": model.state_dict()}


def load_and_go_on(model: Any, train: Any) -> dict[str, Any]:
    version = model.load_checkpoint("taken")
    loaded = model.state_dict()
    for s in range(FIRST, FIRST + AGAIN):
        train(s)
    return {"version": version, "loaded": loaded, "after": model.state_dict()}


def check(got: list[dict[str, Any]], want: dict[str, Any], addresses: list[str]) -> None:
    c = ShardClient(ClusterSpec(addresses))
    try:
        assert not [j for j in server_jobs(c).jobs if ".carry" in j]
    finally:
        c.close()
    for r, each in enumerate(got):
        assert each["version"] == want["version"], r
        assert set(each["loaded"]) == set(want["taken"]), r
        for name, value in want["taken"].items():
            assert each["loaded"][name].equal(value), f"rank {r}: '{name}' loaded otherwise"
        for name, value in want["after"].items():
            off = (each["after"][name] - value).abs().max().item()
            assert off <= 1e-9, f"rank {r}: '{name}' is {off:.3g} off"


@pytest.fixture
def servers(tmp_path):
    nodes = [ShardServer("127.0.0.1", 0, snapshot_dir=str(tmp_path)).start() for _ in range(2)]
    yield [n.address for n in nodes]
    for n in nodes:
        n.stop(0)


def test_a_data_parallel_snapshot_loads_into_a_3d_model(servers):
    job = f"carry-{uuid.uuid4().hex[:6]}"
    want = run_fsdp(servers, job, save_and_go_on)[0]
    got = run_hybrid(2, 2, 1, servers, job, lambda model, opt, train: load_and_go_on(model, train))
    check(got, want, servers)


def test_a_3d_snapshot_loads_into_a_data_parallel_model(servers):
    job = f"carry-{uuid.uuid4().hex[:6]}"
    want = run_hybrid(2, 2, 1, servers, job, lambda model, opt, train: save_and_go_on(model, train))
    got = run_fsdp(servers, job, load_and_go_on)
    check(got, want[0], servers)
    c = ShardClient(ClusterSpec(servers))
    try:  # the name holds both kinds now: a drop takes both
        assert tools.drop(c, job) == [job, f"{job}.pp0.tp0", f"{job}.pp0.tp1", f"{job}.pp1.tp0",
                                      f"{job}.pp1.tp1"]  # fmt: skip
        assert server_jobs(c).jobs == []
    finally:
        c.close()


def test_rank_0s_reason_reaches_every_rank(servers):
    """A tag that does not exist: rank 0's restore fails, and every rank says why (before,
    the others said only that rank 0 failed, and the launcher showed whichever line came
    first)."""
    job = f"carry-{uuid.uuid4().hex[:6]}"
    run_fsdp(servers, job, save_and_go_on)

    def load(model: Any, opt: Any, train: Any) -> str:
        try:
            model.load_checkpoint("nope")
        except Exception as exc:  # noqa: BLE001 - each rank's words are what is checked
            return str(exc)
        return "loaded"

    said = run_hybrid(2, 1, 1, servers, job, load)
    assert all("'nope'" in each for each in said), said
    assert "rank 0 could not restore snapshot 'nope'" in said[1] and "tags: taken" in said[1]


def test_a_snapshot_before_the_first_step_resets_the_moments(servers):
    """A 3D snapshot taken before any step holds no optimizer state; the FSDP model that
    loads it has trained (its servers made Adam's moments and counted steps): they are zeros
    again, and its steps from there are those of a run that starts afresh."""
    job = f"carry-{uuid.uuid4().hex[:6]}"

    def save_first(model: Any, opt: Any, train: Any) -> int:
        return model.save_checkpoint("taken")

    def trained_then_loaded(model: Any, train: Any) -> dict[str, Any]:
        for s in range(FIRST):
            train(s)
        model.load_checkpoint("taken")
        for s in range(FIRST, FIRST + AGAIN):
            train(s)
        return model.state_dict()

    def fresh(model: Any, train: Any) -> dict[str, Any]:
        for s in range(FIRST, FIRST + AGAIN):
            train(s)
        return model.state_dict()

    run_hybrid(2, 2, 1, servers, job, save_first)
    got = run_fsdp(servers, job, trained_then_loaded)
    want = run_fsdp(servers, f"{job}-fresh", fresh)[0]
    for r, each in enumerate(got):
        for name, value in want.items():
            off = (each[name] - value).abs().max().item()
            assert off <= 1e-9, f"rank {r}: '{name}' is {off:.3g} off"


def test_another_optimizers_state_is_refused_before_any_write(servers, capsys):
    """SGD's momentum loaded by an AdamW model: refused on every rank, parameters kept."""
    job = f"carry-{uuid.uuid4().hex[:6]}"

    def save(model: Any, opt: Any, train: Any) -> None:
        train(0)
        model.save_checkpoint("taken")

    def load(model: Any, opt: Any, train: Any) -> tuple[str, bool]:
        before = model.state_dict()
        try:
            model.load_checkpoint("taken")
        except RuntimeError as exc:
            after = model.state_dict()
            return str(exc), all(after[k].equal(v) for k, v in before.items())
        return "loaded", False

    run_hybrid(1, 2, 1, servers, job, save, make_opt=sgd)
    # the servers still hold the job in its old layout, which a new layout cannot register
    # over: `paramshard drop` takes every part off (a name they do not hold is one line)
    where = ["--servers", ",".join(servers)]
    assert main(["drop", job, *where]) == 0
    assert f"dropped {job}.pp0.tp0, {job}.pp0.tp1" in capsys.readouterr().out
    assert main(["drop", job, *where]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    for said, kept in run_hybrid(2, 1, 1, servers, job, load):
        assert "its optimizer state is sgd's, this model's optimizer is adamw" in said, said
        assert kept
