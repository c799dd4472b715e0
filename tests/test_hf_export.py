"""Hugging Face export (issue 12 item 3): a ``PreTrainedModel`` trained by ZeRO-1, ZeRO-2 or
FSDP exports as ``config.json`` + ``model.safetensors`` that ``AutoModelForCausalLM
.from_pretrained`` loads with exactly the weights the servers hold, live (``export_hf``,
``paramshard export JOB --hf-dir``) and offline from a snapshot folder (``--snapshot``), in
the training dtype (float64 here).

The servers record the model's class and ``config.to_dict()`` when the job registers
(RegisterBufferRequest.model_config); snapshots and restores keep it, and a server refuses a
description over 1 MiB or not a JSON object with INVALID_ARGUMENT, storing nothing. GPT-2 ties
``lm_head.weight`` to ``transformer.wte.weight``: the file holds the tied tensor once and
``from_pretrained`` ties it again; Llama (untied) keeps both. A ``HybridShardedModel`` job
exports by its base name: its stages are pruned copies of the model, so each part records the
config, and the tensor-parallel parts are joined. DDP keeps nothing on the servers: its model
is on every rank (``model.module.save_pretrained``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import torch
from conftest import run_ranks
from safetensors import safe_open
from test_hf_float64 import CFG as GPT2_CFG
from test_hf_float64 import batches, logits_loss
from test_hf_llama import llama_config
from test_strategies import STRATEGIES

from paramshard.cli import CommandError, main
from paramshard.client import ClusterSpec, ParamInfo, ShardClient, ShardClientError, tools
from paramshard.client.export_hf import export_hf
from paramshard.offline_export import export_snapshot, recorded_model
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.manifest import MODEL_CONFIG_MAX_BYTES, new_manifest
from paramshard.server.snapshots.manifest_schema import ManifestError, check_manifest
from paramshard.strategies import ShardingConfiguration
from paramshard.strategies.base import hf_model_config

transformers = pytest.importorskip("transformers")

WORLD, STEPS = 2, 2
MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(GPT2_CFG),  # tied
    "llama": lambda: transformers.LlamaForCausalLM(llama_config()),  # untied
}


def train(addresses: list[str], strategy: str, model: str) -> tuple[str, dict[str, torch.Tensor]]:
    """WORLD ranks train STEPS steps of a float64 ``model``; snapshot "t" at the end. Returns
    the job and the trained state_dict."""
    torch.manual_seed(0)
    init = MODELS[model]().double().state_dict()
    data = batches(steps=STEPS, batch=WORLD * 2)
    job = f"hf-{model}-{uuid.uuid4().hex[:6]}"
    model_cls, opt_cls = STRATEGIES[strategy]

    def rank(client: ShardClient) -> dict[str, torch.Tensor]:
        net = MODELS[model]().double()
        net.load_state_dict(init)
        config = ShardingConfiguration(client, job=job)
        wrapped = model_cls(net, config)  # FSDP: the model's _no_split_modules are the units
        opt = opt_cls(torch.optim.AdamW(net.parameters(), lr=1e-2), config)
        for s in range(STEPS):
            logits_loss(wrapped, data[s, client.rank * 2 : client.rank * 2 + 2]).backward()
            opt.step()
            opt.zero_grad()
        if client.rank == 0:
            tools.snapshot(client, job, "t")
        client.barrier()
        return wrapped.state_dict()

    return job, run_ranks(rank, WORLD, addresses)[0]


def check_folder(folder: Any, model: str, trained: dict[str, torch.Tensor]) -> None:
    """``from_pretrained(folder)`` is the trained model: its class, config, dtype and exactly
    the servers' weights; a tied weight is stored once and tied again."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert meta["format"] == "pt"
    assert ("lm_head.weight" in keys) == (model == "llama")  # GPT-2 ties it: stored once
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded).__name__ == type(MODELS[model]()).__name__
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "float64" and config["architectures"] == [type(loaded).__name__]
    assert same_config(loaded, MODELS[model]())
    state = loaded.state_dict()
    assert set(state) == set(trained)
    for name, value in trained.items():
        assert state[name].dtype == torch.float64, name
        assert torch.equal(state[name], value), name
    if model == "gpt2":
        assert loaded.lm_head.weight is loaded.transformer.wte.weight


def same_config(loaded: torch.nn.Module, built: torch.nn.Module) -> bool:
    """The configs agree but for what export sets (class, dtype) and transformers' version."""
    ignore = {"architectures", "dtype", "transformers_version", "_name_or_path"}
    a, b = loaded.config.to_dict(), built.config.to_dict()
    return {k: v for k, v in a.items() if k not in ignore} == {
        k: v for k, v in b.items() if k not in ignore
    }


@pytest.fixture(scope="module")
def snapshot_root(tmp_path_factory) -> Any:
    return tmp_path_factory.mktemp("hf-snaps")


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_export_hf_loads_with_from_pretrained(servers, snapshot_root, tmp_path, strategy, model):
    addresses = [s.address for s in servers(WORLD, snapshot_dir=str(snapshot_root))]
    job, trained = train(addresses, strategy, model)
    client = ShardClient(ClusterSpec(addresses), timeout_s=20.0)
    try:
        count = export_hf(client, job, tmp_path / "live")
    finally:
        client.close()
    assert count == len({p for p in trained if not (model == "gpt2" and p == "lm_head.weight")})
    check_folder(tmp_path / "live", model, trained)
    assert export_snapshot(snapshot_root / job / "t", hf_dir=tmp_path / "offline") == count
    check_folder(tmp_path / "offline", model, trained)
    recorded = json.loads((snapshot_root / job / "t" / "manifest.json").read_text())
    assert recorded["model_config"]["architecture"] == type(MODELS[model]()).__name__
    assert recorded["model_config"]["config"] == json.loads(
        MODELS[model]().config.to_json_string(use_diff=False)
    )


def test_cli_export_hf_live_offline_and_after_restore(servers, snapshot_root, tmp_path) -> None:
    addresses = [s.address for s in servers(WORLD, snapshot_dir=str(snapshot_root))]
    job, trained = train(addresses, "fsdp", "gpt2")
    where = ["--servers", ",".join(addresses)]
    assert main(["export", job, "--hf-dir", str(tmp_path / "live"), *where]) == 0
    check_folder(tmp_path / "live", "gpt2", trained)
    folder = str(snapshot_root / job / "t")
    assert main(["export", "--snapshot", folder, "--hf-dir", str(tmp_path / "off")]) == 0
    check_folder(tmp_path / "off", "gpt2", trained)
    assert main(["export", job, *where]) == 2  # neither --out nor --hf-dir
    assert main(["export", job, "--out", "x", "--hf-dir", "y", *where]) == 2
    # dropped and restored: the job has its model config again
    client = ShardClient(ClusterSpec(addresses), timeout_s=20.0)
    try:
        for i in range(WORLD):
            client.call(i, "DropJob", pb.DropJobRequest(job=job))
        tools.restore(client, job, "t")
        assert export_hf(client, job, tmp_path / "restored") == len(trained) - 1
    finally:
        client.close()
    check_folder(tmp_path / "restored", "gpt2", trained)


def test_a_job_of_another_model_has_no_config(servers, tmp_path) -> None:
    """The example GPT is not a PreTrainedModel: nothing recorded, a clear error."""
    from paramshard.models.gpt import GPT, GPTConfig
    from paramshard.strategies import ZeRO1Model, ZeRO1Optimizer

    (server,) = servers(1)
    client = ShardClient(ClusterSpec([server.address]))
    try:
        net = GPT(GPTConfig.tiny())
        assert hf_model_config(net) == ""
        config = ShardingConfiguration(client, job="plain")
        model = ZeRO1Model(net, config)  # registers when its optimizer attaches
        ZeRO1Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
        with pytest.raises(RuntimeError, match="no model config on the servers"):
            export_hf(client, "plain", tmp_path / "out")
    finally:
        client.close()
    assert not (tmp_path / "out").exists()


# -- the servers bound what they keep -----------------------------------------------------------
def register(client: ShardClient, job: str, model_config: str) -> None:
    client.register_buffer(
        job, "root#g0", 4, params=[ParamInfo("w", (4,), 0)], model_config=model_config
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"architecture": "M", "config": {"x": "' + "a" * MODEL_CONFIG_MAX_BYTES + '"}}', "over"),
        ("not json", "not JSON"),
        ('["a list"]', '"config" object'),
        ('{"architecture": "../../x", "config": {}}', "class name"),
    ],
    ids=["over-1MiB", "not-json", "not-an-object", "bad-class-name"],
)
def test_server_refuses_a_bad_model_config(servers, bad: str, message: str) -> None:
    (server,) = servers(1)
    client = ShardClient(ClusterSpec([server.address]), retries=0)
    try:
        with pytest.raises(ShardClientError, match=message) as err:
            register(client, "hostile", bad)
        assert err.value.code.name == "INVALID_ARGUMENT"
        assert not client.call(0, "Status", pb.StatusRequest()).jobs  # nothing stored
        good = json.dumps({"architecture": "M", "config": {"n": 1}})
        register(client, "fine", good)
        (status,) = client.call(0, "Status", pb.StatusRequest()).jobs
        assert json.loads(status.model_config) == json.loads(good)
    finally:
        client.close()


def test_a_manifest_with_a_bad_model_config_is_refused() -> None:
    shards = [{"file": "j/t/shard-0-of-1.safetensors", "server": 0, "bytes": 1, "sha256": "0" * 64}]
    good = new_manifest(
        "j", "t", 0, 1, {}, shards, model_config='{"architecture": "M", "config": {}}'
    )
    assert check_manifest(good, "j", "t", strict=True)["model_config"]["architecture"] == "M"
    for bad in ({"architecture": "M"}, {"architecture": "M", "config": {"x": "a" * (1 << 20)}}):
        with pytest.raises(ManifestError, match="model_config"):
            check_manifest({**good, "model_config": bad}, "j", "t", strict=True)


def test_offline_export_hf_needs_a_recorded_config(tmp_path) -> None:
    """A snapshot without a model config (not a PreTrainedModel's, or taken by an older
    client): --hf-dir says so (--out works as before)."""
    with pytest.raises(CommandError, match="no model config"):
        recorded_model([{"job": "j"}], tmp_path)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_3d_job_exports_the_whole_model(servers, snapshot_root, tmp_path, model) -> None:
    """HybridShardedModel at (pp, tp, dp) = (2, 2, 1): its parts record the whole model's
    config, and export_hf joins the tensor-parallel parts of every stage (GPT-2's tied head on
    the last stage and embedding on the first are one tensor again)."""
    from test_hybrid_any_model import MODELS as HYBRID_MODELS
    from test_hybrid_any_model import VOCAB, _inputs, _loss

    from paramshard.strategies import HybridShardedModel, HybridShardedOptimizer

    make, split, _, _ = HYBRID_MODELS[model]
    torch.manual_seed(0)
    init = make().double().state_dict()
    data = torch.randint(0, VOCAB, (STEPS, 4, 9), generator=torch.Generator().manual_seed(1))
    addresses = [s.address for s in servers(2, snapshot_dir=str(snapshot_root))]
    job = f"hf3d-{model}-{uuid.uuid4().hex[:6]}"

    def rank(client: ShardClient) -> dict[str, torch.Tensor]:
        net = make().double()
        net.load_state_dict(init)
        config = ShardingConfiguration(client, job=job)
        wrapped = HybridShardedModel(
            net, config, 2, 2, 1, micro_batch_count=2, split_points=[split]
        )
        wrapped.default_loss_function = _loss
        HybridShardedOptimizer(torch.optim.AdamW(wrapped.parameters(), lr=1e-2), config)
        for s in range(STEPS):
            wrapped.train_on_batch(_inputs(model, data[s, :, :-1]), data[s, :, 1:])
        if client.rank == 0:
            tools.snapshot(client, job, "t")
        client.barrier()
        return wrapped.state_dict()

    trained = run_ranks(rank, 4, addresses)[0]
    client = ShardClient(ClusterSpec(addresses), timeout_s=20.0)
    try:
        export_hf(client, job, tmp_path / "live")
    finally:
        client.close()
    for folder in (tmp_path / "live", tmp_path / "offline"):
        if folder.name == "offline":
            export_snapshot(snapshot_root / job / "t", hf_dir=folder)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert same_config(loaded, make())  # head counts as built, not as one part has them
        state = loaded.state_dict()
        assert set(state) == set(trained)
        for name, value in trained.items():
            assert state[name].dtype == torch.float64 and torch.equal(state[name], value), name
