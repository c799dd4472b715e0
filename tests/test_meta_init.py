"""A model built on the meta device, made real on each rank for its own stage and tensor parts
only (strategies/pipeline/materialize.py): from a state dict, a safetensors checkpoint read
part by part, or a seeded init replayed in a whole build's order. Float64; the same values as
the model built whole, the same training as single-process within tests/numerics.py's bound,
and each rank holding its share of the bytes, not the model."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from numerics import assert_equivalent
from safetensors.torch import save_file
from test_hybrid_any_model import BATCH, MODELS, STEPS, T, _inputs, _loss, single_process
from test_pipeline_any_model import VOCAB, MyTransformer
from torch import nn

from paramshard.client import ClusterSpec, ShardClient
from paramshard.server import ShardServer
from paramshard.strategies import HybridShardedModel, HybridShardedOptimizer, ShardingConfiguration
from paramshard.strategies.pipeline.materialize import WeightInit, initialize_model
from paramshard.strategies.pipeline.split import plan_stages

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.usefixtures("one_torch_thread")]
SEED = 5


def user_init(module: nn.Module) -> None:
    """The user transformer's init: its position table (its only tensor no reset_parameters
    sets), the rest as its layers' reset_parameters left them."""
    if isinstance(module, MyTransformer):
        nn.init.normal_(module.pos, std=0.1)


def _make(name: str) -> nn.Module:
    return MODELS[name][0]().double()


def _meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return _make(name)


def _seeded_init(name: str, model: nn.Module):
    return user_init if name == "user" else model._init_weights


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**model.state_dict(), **dict(model.named_buffers())}


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), what
    for k, value in want.items():
        torch.testing.assert_close(got[k], value, rtol=0, atol=0, msg=f"{what}: {k}")


# -- the replayed order is a whole build's ---------------------------------------------------
def test_a_seeded_init_replays_hugging_faces_own_build():
    """reset_parameters children first, then each PreTrainedModel's post_init: the random
    stream of ``torch.manual_seed(s); LlamaForCausalLM(cfg)`` itself (rotary tables too). In
    float32, the dtype both are built in: the draws depend on the dtype."""
    make = MODELS["llama"][0]
    torch.manual_seed(SEED)
    built = make()
    with torch.device("meta"):
        meta = make()
    initialize_model(meta, meta._init_weights, init_seed=SEED)
    _assert_same(_state(meta), _state(built), "llama")


class TiedLM(nn.Module):
    """Layers initialised by their reset_parameters, the head tied to the embedding after it
    was built (its own weight, drawn and dropped)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 8)
        self.mid = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.tok.weight


def test_a_tied_weight_keeps_its_first_modules_init():
    torch.manual_seed(SEED)
    built = TiedLM()
    with torch.device("meta"):
        meta = TiedLM()
    initialize_model(meta, "reset_parameters", init_seed=SEED)
    _assert_same(_state(meta), _state(built), "tied")
    assert meta.head.weight is meta.tok.weight


# -- errors that name the field or the tensor ---------------------------------------------------
def test_init_device_moves_the_made_real_tensors_keeping_the_ties_and_the_values():
    whole = _make("llama")
    initialize_model(whole, whole._init_weights, init_seed=SEED)
    model = _meta("llama")
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    # "meta" stands in for a GPU here: any device but the CPU the values were set on
    WeightInit(model, model._init_weights, SEED).materialize(plan_stages(model, []), model, "meta")
    assert {t.device.type for t in _state(model).values()} == {"meta"}
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    model = _meta("llama")
    WeightInit(model, model._init_weights, SEED).materialize(plan_stages(model, []), model, "cpu")
    _assert_same(_state(model), _state(whole), "init_device=cpu")


def test_errors_name_the_tensor_or_the_field():
    with pytest.raises(ValueError, match=r"\['pos'\] is set by no replayed init"):
        initialize_model(_meta("user"), "reset_parameters", init_seed=0)
    with pytest.raises(ValueError, match="needs init_seed"):
        initialize_model(_meta("user"), user_init)
    with pytest.raises(ValueError, match="init_seed=3 is for a seeded init_weights"):
        initialize_model(_meta("user"), {}, init_seed=3)
    with pytest.raises(ValueError, match="got 'no/such.safetensors'"):
        initialize_model(_meta("user"), "no/such.safetensors")
    with pytest.raises(ValueError, match=r"no tensor for 1 of this rank's: \['layers.0.q.bias'\]"):
        full = _make("user").state_dict()
        del full["layers.0.q.bias"]
        initialize_model(_meta("user"), full)
    with pytest.raises(ValueError, match="are on the meta device: pass init_weights"):
        initialize_model(_meta("user"), None)

    def reaches_out(module: nn.Module) -> None:  # a path module touching a block's weight
        if isinstance(module, nn.ModuleList):
            nn.init.zeros_(module[0].q.weight)

    with pytest.raises(ValueError, match="init_device='cpu' is where a meta-built model"):
        WeightInit(_make("user"), None, None).materialize(
            plan_stages(_make("user"), []), None, "cpu"
        )

    model = _meta("user")  # one unit at a time: the blocks are units, the ModuleList a path
    init = WeightInit(model, reaches_out, 0)
    with pytest.raises(RuntimeError, match="fn of 'layers' uses 'layers.0.q.weight'"):
        init.materialize(plan_stages(model, ["layers.2"]), model)


# -- 3D training from a meta model -------------------------------------------------------------
def _init_values(name: str, source: str, tmp_path) -> tuple[dict, object, int | None]:
    """(the whole model's initial state dict, ``init_weights``, ``init_seed``)."""
    if source == "seeded":
        whole = _make(name)
        initialize_model(whole, _seeded_init(name, whole), init_seed=SEED)
        return whole.state_dict(), None, SEED
    torch.manual_seed(SEED)
    whole = _make(name)
    state = whole.state_dict()
    if source == "state_dict":
        return state, state, None
    if name == "llama":  # a Hugging Face checkpoint directory in several shards
        whole.save_pretrained(tmp_path, max_shard_size="20KB")
        assert (tmp_path / "model.safetensors.index.json").exists()
        return state, str(tmp_path), None
    # one file; the tied head only under the embedding's name, as checkpoints keep it
    path = tmp_path / "model.safetensors"
    save_file({k: v.clone() for k, v in state.items() if k != "head.weight"}, str(path))
    return state, path, None


def _real_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the real (not meta) tensors these modules hold, each tensor once."""
    tensors = {id(t): t for m in modules for t in [*m.parameters(), *m.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values() if not t.is_meta)


def _train_from_meta(name, layout, init_weights, init_seed, data):
    pp, tp = layout
    world = pp * tp
    _, split, plan, _ = MODELS[name]
    nodes = [ShardServer().start() for _ in range(2)]
    run, job = uuid.uuid4().hex[:6], f"meta-{uuid.uuid4().hex[:6]}"

    def rank(r):
        client = ShardClient(
            ClusterSpec([n.address for n in nodes]), rank=r, world_size=world, run_id=run
        )
        config = ShardingConfiguration(client, job=job)
        net = _meta(name)
        how = _seeded_init(name, net) if init_seed is not None else init_weights
        model = HybridShardedModel(
            net, config, pp, tp, 1, micro_batch_count=2, split_points=[split],
            parallelize_plan=plan, init_weights=how, init_seed=init_seed,
        )  # fmt: skip
        # what this rank holds: its stage's tensors (the runners' skeletons share them), all
        # real; the user's model object keeps the other ranks' modules on meta
        runners = [runner.module for runner in model.pipeline._runners]
        assert not any(t.is_meta for t in [*model.stage.parameters(), *model.stage.buffers()])
        held = _real_bytes([model.stage, *runners])
        everything = _real_bytes([model.stage, *runners, net])
        splits = model.replica.param_splits
        names = {
            id(t): n for n, t in [*model.stage.named_buffers(), *model.stage.named_parameters()]
        }
        initial = model.state_dict()
        model.default_loss_function = _loss
        HybridShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
        losses = []
        for s in range(STEPS):
            batch = data[s]
            losses.append(model.train_on_batch(_inputs(name, batch[:, :-1]), batch[:, 1:]))
        return initial, losses, model.state_dict(), held, everything, names, splits

    try:
        with ThreadPoolExecutor(world) as pool:
            return [f.result(timeout=600) for f in [pool.submit(rank, r) for r in range(world)]]
    finally:
        for n in nodes:
            n.stop()


def _share(whole: dict[str, torch.Tensor], names: dict, splits: dict, tp: int) -> int:
    """Bytes of a rank's share: its tensors, a tensor-parallel one's 1/tp (even splits here)."""
    total = 0
    for n in names.values():
        t = whole[n]
        total += t.numel() * t.element_size() // (tp if n in splits else 1)
    return total


@pytest.mark.slow
@pytest.mark.equivalence
@pytest.mark.parametrize("layout", [(2, 1), (2, 2)], ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("source", ["state_dict", "safetensors", "seeded"])
@pytest.mark.parametrize("name", ["user", "llama"])
def test_a_meta_model_trains_like_the_model_built_whole(name, source, layout, tmp_path):
    init, init_weights, init_seed = _init_values(name, source, tmp_path)
    data = torch.randint(
        0, VOCAB, (STEPS, BATCH, T + 1), generator=torch.Generator().manual_seed(1)
    )
    ref_losses, ref_state = single_process(name, init, data)
    reference = _make(name)
    reference.load_state_dict(init)
    whole = _state(reference)
    whole_bytes = _real_bytes([reference])
    results = _train_from_meta(name, layout, init_weights, init_seed, data)
    for r, (initial, losses, state, held, everything, names, splits) in enumerate(results):
        what = f"{name} {source} {layout} rank {r}"
        _assert_same(initial, init, what + " initial")  # the very values, before training
        assert_equivalent(losses, ref_losses, what + " losses")
        assert_equivalent(state, ref_state, what)
        # no rank holds the model: its share of the bytes and nothing else, 50-54% of the model
        # at pp 2 and 25-33% at (2, 2) (these tiny models' embeddings are a large part, whole
        # on every tensor rank)
        assert everything == held == _share(whole, names, splits, layout[1]), what
        assert held < {1: 0.55, 2: 0.34}[layout[1]] * whole_bytes, (what, held, whole_bytes)
