"""Snapshots, export, get and restore of 3D-parallel jobs by their base name.

A ``HybridShardedModel`` job ``J`` is one server job per (pipeline stage, tensor rank),
``J.pp<s>.tp<t>``; the tools join the tensor-parallel parts (fused q|k|v blocks included) and
take replicated tensors from tensor rank 0, every stage, the tied embedding's two copies as
``wte.weight`` and ``lm_head.weight``. Ranks are threads (torch limited to one thread each),
servers in-process with one shared snapshot directory, as in test_hybrid.py. The model is
float64 (servers keep float64 masters for it), so every round trip is float64 end to end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hybrid_runs import (
    AGAIN,
    CFG,
    FIRST,
    assert_equal_state,
    batches,
    checkpoint_and_replay,
    client_for,
    live_export,
    new_gpt,
    run_hybrid,
)
from safetensors import safe_open
from safetensors.torch import load_file

from paramshard.cli import main
from paramshard.client import ShardClientError, tools
from paramshard.client.jobs import server_jobs
from paramshard.client.tensor_parts import parse_part_job
from paramshard.models.gpt import GPT
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.strategies.topology import Topology

TOPOLOGIES = [(2, 2, 2), (1, 2, 1), (2, 1, 1)]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=TOPOLOGIES, ids=lambda t: "pp{}-tp{}-dp{}".format(*t))
def trained(request, tmp_path_factory) -> Any:
    pp, tp, dp = request.param
    root = tmp_path_factory.mktemp("snaps")
    nodes = [ShardServer("127.0.0.1", 0, snapshot_dir=str(root)).start() for _ in range(2)]
    addresses = [n.address for n in nodes]
    job = f"gpt3d-{uuid.uuid4().hex[:6]}"
    try:
        results = run_hybrid(pp, tp, dp, addresses, job, checkpoint_and_replay)
        yield {
            "topology": (pp, tp, dp),
            "addresses": addresses,
            "job": job,
            "root": root,
            "results": results,
            "parts": [f"{job}.pp{s}.tp{t}" for s in range(pp) for t in range(tp)],
        }
    finally:
        for n in nodes:
            n.stop(0)


def cli(*args: str) -> int:
    return main([str(a) for a in args])


# -- export -----------------------------------------------------------------------------------
def test_live_export_is_the_whole_model(trained, tmp_path):
    job, results = trained["job"], trained["results"]
    final = results[0]["final"]
    for r, res in enumerate(results):  # every rank's state_dict() is the whole model
        assert_equal_state(res["final"], final, f"rank {r}")
    assert set(final) == set(GPT(CFG).state_dict())  # lm_head.weight included
    loaded = live_export(trained["addresses"], job, tmp_path / "live.safetensors")
    assert_equal_state(loaded, final, "live export")
    with safe_open(str(tmp_path / "live.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta["job"] == job and meta["version"] == str(FIRST + AGAIN)
    assert meta["parts"].split(",") == trained["parts"]

    fresh = new_gpt()
    fresh.load_state_dict(loaded, strict=True)
    reference = new_gpt()
    reference.load_state_dict(final)
    x = batches(1)[0, :, :-1]
    with torch.no_grad():
        assert torch.equal(fresh(x), reference(x))


def test_get_and_inspect_by_the_base_name(trained, tmp_path):
    job, final = trained["job"], trained["results"][0]["final"]
    c = client_for(trained["addresses"])
    try:
        for name in ("blocks.1.attn.c_attn.weight", "blocks.3.mlp.c_proj.weight", "lm_head.weight"):
            np.testing.assert_array_equal(tools.get_param(c, job, name), final[name].numpy())
        with pytest.raises(KeyError, match="nosuch.weight"):
            tools.get_param(c, job, "nosuch.weight")
        rows = {r["name"]: r for r in tools.inspect(c, job)}
    finally:
        c.close()
    assert set(rows) | {"lm_head.weight"} >= set(final)
    w = final["blocks.0.attn.c_attn.weight"].double()
    assert rows["blocks.0.attn.c_attn.weight"]["shape"] == list(w.shape)
    assert rows["blocks.0.attn.c_attn.weight"]["norm"] == pytest.approx(float(w.norm()), 1e-6)

    out = tmp_path / "w.npy"
    assert cli("get", job, "blocks.2.attn.c_attn.weight", "--out", out, "--servers",
               ",".join(trained["addresses"])) == 0  # fmt: skip
    np.testing.assert_array_equal(np.load(out), final["blocks.2.attn.c_attn.weight"].numpy())


def test_offline_export_of_a_checkpoint(trained, tmp_path):
    job, root = trained["job"], trained["root"]
    assert not (root / job).exists() and all((root / p / "t1").is_dir() for p in trained["parts"])
    out = tmp_path / "offline.safetensors"
    assert cli("export", "--snapshot", root / job / "t1", "--out", out) == 0
    assert_equal_state(load_file(str(out)), trained["results"][0]["t1"], "offline export")
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["version"] == str(FIRST) and f.metadata()["tag"] == "t1"


@pytest.mark.equivalence
def test_load_checkpoint_replays_the_same_steps(trained):
    for r, res in enumerate(trained["results"]):
        assert res["version"] == FIRST
        assert_equal_state(res["reloaded"], res["t1"], f"rank {r} after load_checkpoint")
        assert res["again"] == res["first"], f"rank {r}"
        assert_equal_state(res["final"], res["after_first"], f"rank {r}")


# -- snapshot and restore through the tools, by the base name ---------------------------------
def test_snapshot_restore_by_the_base_name(trained, tmp_path, capsys):
    job, root, addresses = trained["job"], trained["root"], trained["addresses"]
    servers = ",".join(addresses)
    res = trained["results"][0]
    c = client_for(addresses)
    try:
        summary = tools.snapshot(c, job, "t2")
        assert summary["job"] == job and summary["tag"] == "t2"
        assert summary["version"] == FIRST + AGAIN and summary["parts"] == trained["parts"]
        rows = [r for r in tools.list_snapshots(c, job, combine_parts=True) if r["tag"] == "t2"]
        assert rows == [{**rows[0], "job": job, "parts": trained["parts"]}]

        # back to t1 with the CLI, then the live servers hold t1's model
        assert cli("restore", job, "--tag", "t1", "--servers", servers) == 0
        assert f"version {FIRST}" in capsys.readouterr().out
        loaded = live_export(addresses, job, tmp_path / "t1.safetensors")
        assert_equal_state(loaded, res["t1"], "restored t1")

        # a copy of t2 whose last part is corrupt: refused before any part is swapped
        for part in trained["parts"]:
            shutil.copytree(root / part / "t2", root / part / "bad")
            manifest = json.loads((root / part / "bad" / "manifest.json").read_text())
            (root / part / "bad" / "manifest.json").write_text(
                json.dumps({**manifest, "tag": "bad"})
            )
        # (each part has a shard per server of its data-parallel group: the last of them)
        shard = sorted((root / trained["parts"][-1] / "bad").glob("shard-*.safetensors"))[-1]
        raw = bytearray(shard.read_bytes())
        raw[-3] ^= 0x01
        shard.write_bytes(bytes(raw))
        with pytest.raises(ShardClientError, match="checksum"):
            tools.restore(c, job, "bad")
        loaded = live_export(addresses, job, tmp_path / "still-t1.safetensors")
        assert_equal_state(loaded, res["t1"], "after the refused restore")

        # latest: t2 (the newest every part has); the CLI snapshot of the base name
        assert tools.restore(c, job) == FIRST + AGAIN
        loaded = live_export(addresses, job, tmp_path / "t2.safetensors")
        assert_equal_state(loaded, res["final"], "restored latest")
        assert cli("snapshot", job, "--tag", "t3", "--servers", servers) == 0
        assert f"{len(trained['parts'])} parts" in capsys.readouterr().out
        out = tmp_path / "t3.safetensors"
        assert cli("export", "--snapshot", root / job / "t3", "--out", out) == 0
        assert_equal_state(load_file(str(out)), res["final"], "offline export of t3")
    finally:
        c.close()


def part_servers(addresses: list[str], job: str) -> dict[str, dict[int, int]]:
    """part job -> {slice index: server} as the servers' Status says."""
    out: dict[str, dict[int, int]] = {}
    c = client_for(addresses)
    try:
        for i in range(len(addresses)):
            for j in c.call(i, "Status", pb.StatusRequest()).jobs:
                if j.job.startswith(f"{job}.pp"):
                    assert j.num_servers > 0, j.job
                    out.setdefault(j.job, {})[j.server_index] = i
    finally:
        c.close()
    return out


def data_group_servers(trained: Any, stage: int, tensor_rank: int) -> list[int]:
    """The servers of the data-parallel group of (stage, tensor rank): its ranks' own."""
    pp, tp, dp = trained["topology"]
    topo = Topology(pp * tp * dp, pp, tp, dp)
    n = len(trained["addresses"])
    ranks = [topo.rank_of(stage, tensor_rank, d) for d in range(dp)]
    return list(dict.fromkeys(r % n for r in ranks))


def test_each_part_lives_on_its_data_parallel_groups_servers(trained):
    """ZeRO within the data-parallel group: part (s, t) is sharded over the servers of the
    ranks that hold it, slice k on the k-th of them, and on no other server."""
    pp, tp, _ = trained["topology"]
    held = part_servers(trained["addresses"], trained["job"])
    assert sorted(held) == sorted(trained["parts"])
    for s in range(pp):
        for t in range(tp):
            want = data_group_servers(trained, s, t)
            got = held[f"{trained['job']}.pp{s}.tp{t}"]
            assert [got[k] for k in sorted(got)] == want, (s, t, got)


@pytest.mark.parametrize("count", [2, 3])
def test_restore_into_fresh_servers(trained, tmp_path, count):
    """A restore into a new cluster of the same size puts each part back on the servers it
    was on (by their index); into another size, every part is resharded over every server.
    Either way the live model is t1's."""
    job, root = trained["job"], trained["root"]
    nodes = [ShardServer("127.0.0.1", 0, snapshot_dir=str(root)).start() for _ in range(count)]
    addresses = [n.address for n in nodes]
    try:
        c = client_for(addresses)
        try:
            assert tools.restore(c, job, "t1") == FIRST
        finally:
            c.close()
        held = part_servers(addresses, job)
        assert sorted(held) == sorted(trained["parts"])
        for name, where in held.items():
            _, s, t = parse_part_job(name)
            want = data_group_servers(trained, s, t) if count == 2 else list(range(count))
            assert [where[k] for k in sorted(where)] == want, (name, where)
        loaded = live_export(addresses, job, tmp_path / f"fresh{count}.safetensors")
        assert_equal_state(loaded, trained["results"][0]["t1"], f"restored into {count}")
    finally:
        for n in nodes:
            n.stop(0)


def serve_restore(nodes: list[ShardServer], root: Path, tag: str) -> None:
    """What ``paramshard serve --snapshot-dir root --restore tag --index i`` does at start,
    on each of ``nodes`` (i its place in the list)."""
    from paramshard.serve_setup import restore_at_start

    for i, node in enumerate(nodes):
        args = argparse.Namespace(snapshot_dir=str(root), restore=tag, index=i, num_servers=None)
        restore_at_start(node, args)


def test_serve_restore_at_start_takes_back_only_its_own_parts(trained, tmp_path, capsys):
    """``serve --restore t1 --index I`` on each server of a new cluster of the old size: a
    server loads the slices it held of the parts it held, and skips the others."""
    job, root = trained["job"], trained["root"]
    nodes = [ShardServer("127.0.0.1", 0, snapshot_dir=str(root)).start() for _ in range(2)]
    addresses = [n.address for n in nodes]
    try:
        serve_restore(nodes, root, "t1")
        held = part_servers(addresses, job)
        for name, where in held.items():
            _, s, t = parse_part_job(name)
            assert [where[k] for k in sorted(where)] == data_group_servers(trained, s, t)
        assert sorted(held) == sorted(trained["parts"])
        loaded = live_export(addresses, job, tmp_path / "served.safetensors")
        assert_equal_state(loaded, trained["results"][0]["t1"], "serve --restore")
    finally:
        for n in nodes:
            n.stop(0)


def test_serve_restore_latest_is_the_newest_tag_every_part_has(trained, tmp_path):
    """A newer snapshot of one part alone (the others' commits lost) is not "latest" of a 3D
    job: ``serve --restore latest`` gives every part the newest tag they all have."""
    job, parts = trained["job"], trained["parts"]
    copy = tmp_path / "snaps"
    for part in parts:
        shutil.copytree(trained["root"] / part / "t1", copy / part / "t1")
    solo = copy / parts[0] / "solo"
    shutil.copytree(copy / parts[0] / "t1", solo)
    manifest = json.loads((solo / "manifest.json").read_text())
    manifest.update(tag="solo", created_unix=manifest["created_unix"] + 1000)
    (solo / "manifest.json").write_text(json.dumps(manifest))
    nodes = [ShardServer("127.0.0.1", 0, snapshot_dir=str(copy)).start() for _ in range(2)]
    addresses = [n.address for n in nodes]
    try:
        serve_restore(nodes, copy, "latest")
        c = client_for(addresses)
        try:
            for i in range(2):
                for j in c.call(i, "Status", pb.StatusRequest()).jobs:
                    assert all(b.version == FIRST for b in j.buffers), j.job
        finally:
            c.close()
        loaded = live_export(addresses, job, tmp_path / "latest.safetensors")
        assert_equal_state(loaded, trained["results"][0]["t1"], "serve --restore latest")
        # the same through the tools, into servers that hold nothing: only the snapshots'
        # own records (ListSnapshots) say that "solo" lacks parts
        more = [ShardServer("127.0.0.1", 0, snapshot_dir=str(copy)).start() for _ in range(2)]
        nodes += more
        c = client_for([n.address for n in more])
        try:
            assert tools.restore(c, job) == FIRST
        finally:
            c.close()
        loaded = live_export([n.address for n in more], job, tmp_path / "tools.safetensors")
        assert_equal_state(loaded, trained["results"][0]["t1"], "tools.restore latest")
    finally:
        for n in nodes:
            n.stop(0)


def test_missing_parts_are_named(trained, tmp_path, capsys):
    pp, tp, _ = trained["topology"]
    job, root, parts = trained["job"], trained["root"], trained["parts"]
    copy = tmp_path / "copy"
    for part in parts:
        shutil.copytree(root / part / "t1", copy / part / "t1")
    last = parts[-1]
    shutil.rmtree(copy / last)
    out = tmp_path / "x.safetensors"
    # the manifests list every part, so even a missing last stage or rank is noticed
    assert cli("export", "--snapshot", copy / job / "t1", "--out", out) == 1
    err = capsys.readouterr().err
    assert f"missing {last}" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    if pp > 1:  # a whole stage gone
        for t in range(tp):
            shutil.rmtree(copy / f"{job}.pp{pp - 1}.tp{t}", ignore_errors=True)
        assert cli("export", "--snapshot", copy / job / "t1", "--out", out) == 1
        err = capsys.readouterr().err
        assert all(f"{job}.pp{pp - 1}.tp{t}" in err for t in range(tp)), err
    assert cli("export", "--snapshot", copy / job / "nosuchtag", "--out", out) == 1
    assert "nosuchtag" in capsys.readouterr().err and not out.exists()


CARRY_TO = {(2, 2, 2): (1, 2, 2), (1, 2, 1): (2, 1, 1), (2, 1, 1): (1, 2, 1)}
"""The layout each trained one's snapshot is loaded into: stages and tensor ranks both change."""


def run_carried(trained: Any, body: Any, **kw: Any) -> list:
    """``body`` on every rank of the CARRY_TO layout, over fresh servers of the trained run's
    snapshot folder; checks that nothing a carry loaded stays on them."""
    pp, tp, dp = CARRY_TO[trained["topology"]]
    nodes = [
        ShardServer("127.0.0.1", 0, snapshot_dir=str(trained["root"])).start() for _ in range(2)
    ]
    addresses = [n.address for n in nodes]
    try:
        got = run_hybrid(pp, tp, dp, addresses, trained["job"], body, **kw)
        c = client_for(addresses)
        try:
            held = server_jobs(c).jobs
        finally:
            c.close()
        assert not [j for j in held if ".carry" in j], held
        return got
    finally:
        for n in nodes:
            n.stop(0)


@pytest.mark.equivalence
def test_load_checkpoint_carries_a_snapshot_to_another_layout(trained):
    """A snapshot taken in one pipeline x tensor layout loads into another, as torchtitan's
    and Megatron's checkpoints reshard on load: the same parameters, bitwise, and AGAIN steps
    later the parameters the run that took it reached (float64: 1e-9; the layouts sum in
    other orders). That needs Adam's moments and step count carried too: before, another
    layout was refused, and the weights alone (export, load_state_dict) start Adam afresh,
    whose first steps move each parameter by about lr (3e-3)."""
    want = trained["results"][0]

    def load(model: Any, opt: Any, train: Any) -> dict[str, Any]:
        version = model.load_checkpoint("t1")
        loaded = model.state_dict()
        for s in range(FIRST, FIRST + AGAIN):
            train(s)
        return {"version": version, "loaded": loaded, "after": model.state_dict()}

    for r, each in enumerate(run_carried(trained, load)):
        assert each["version"] == want["version"], r
        assert_equal_state(each["loaded"], want["t1"], f"rank {r} loaded")
        assert set(each["after"]) == set(want["after_first"])
        for name, value in want["after_first"].items():
            moved = (value - want["t1"][name]).abs().max().item()
            off = (each["after"][name] - value).abs().max().item()
            assert off <= 1e-9, f"rank {r}: '{name}' is {off:.3g} off (moved {moved:.3g})"


def test_a_snapshot_that_does_not_fit_is_refused_on_every_rank_before_any_write(trained):
    """A snapshot of another model (a vocabulary of 60, the snapshot's 50) is refused on every
    rank, naming what differs where the rank holds it (the embedding; the last stage's tied
    copy, ``lm_head.weight``), and the model keeps its parameters."""
    wider = dataclasses.replace(CFG, vocab_size=60)

    def load(model: Any, opt: Any, train: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
        before = model.state_dict()
        try:
            model.load_checkpoint("t1")
        except RuntimeError as exc:
            return str(exc), before, model.state_dict()
        return "loaded", before, {}

    got = run_carried(trained, load, cfg=wider)
    for said, before, after in got:
        assert ".weight' is [50, " in said or "another rank could not carry" in said, said
        assert "before any rank wrote" in said or "does not fit this model" in said, said
        assert_equal_state(after, before, "after the refusal")
    assert any("'wte.weight' is [50, " in said for said, _, _ in got)


def test_a_snapshot_of_another_model_in_the_same_layout_is_refused_before_the_swap(trained):
    """The same layout, another model (a vocabulary of 60): the servers compare the snapshot
    with the job they hold before any swap. Before, they swapped it in and the ranks failed
    at their first pull ("outside this server's slice"), the servers holding the snapshot;
    a model with fewer layers hung in a collective for its deadline."""
    pp, tp, dp = trained["topology"]
    wider = dataclasses.replace(CFG, vocab_size=60)
    nodes = [
        ShardServer("127.0.0.1", 0, snapshot_dir=str(trained["root"])).start() for _ in range(2)
    ]
    addresses = [n.address for n in nodes]

    def load(model: Any, opt: Any, train: Any) -> tuple[str, bool]:
        before = model.state_dict()
        try:
            model.load_checkpoint("t1")
        except Exception as exc:  # noqa: BLE001 - each rank's words are what is checked
            after = model.state_dict()
            return str(exc), all(after[k].equal(v) for k, v in before.items())
        return "loaded", False

    try:
        got = run_hybrid(pp, tp, dp, addresses, trained["job"], load, cfg=wider)
    finally:
        for n in nodes:
            n.stop(0)
    for said, kept in got:
        assert "is not of the model that registered job" in said, said
        assert "holds other parameters" in said and "paramshard drop" in said, said
        assert kept
