"""3D parallelism equals single-process training: every (pp, tp, dp) the issue names, 10 steps.

Ranks are threads (torch limited to one thread each), servers in-process; the global batch is
split over the data-parallel replicas and over micro-batches inside each pipeline. Float64 end
to end, losses, clipped norms and final parameters within 1e-9 of single-process float64
(tests/numerics.py).
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch
from numerics import assert_equivalent

from paramshard import LocalCluster
from paramshard.client import ClusterSpec, ShardClient
from paramshard.models.gpt import GPT, GPTConfig, lm_loss
from paramshard.protos import local_servers
from paramshard.server import ShardServer
from paramshard.strategies import HybridShardedModel, HybridShardedOptimizer, ShardingConfiguration

STEPS, BATCH = 10, 8
CFG = GPTConfig.tiny(vocab_size=50, bias=False, n_layer=4)  # bias=False: see test_strategies

pytestmark = pytest.mark.usefixtures("one_torch_thread")
equivalence = pytest.mark.equivalence


MAX_NORM = 0.3  # below the tiny GPT's gradient norms here (0.6 to 2.5): every step clips


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3)


def sgd(params):
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


def new_model(init, net=None):
    """``net`` (a GPT of CFG by default) in the dtype of ``init`` (``.double()`` for float64),
    loaded with it."""
    net = (GPT(CFG) if net is None else net).to(next(iter(init.values())).dtype)
    net.load_state_dict(init)
    return net


def initial_state(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return {k: v.to(dtype).clone() for k, v in GPT(CFG).state_dict().items()}


def single_process(init, data, max_norm=None, make_opt=adamw):
    """Losses, final state and (with ``max_norm``) the clipped norms of plain torch training."""
    model = new_model(init)
    opt = make_opt(model.parameters())
    losses, norms = [], []
    for s in range(STEPS):
        loss = lm_loss(model(data[s, :, :-1]), data[s, :, 1:])
        loss.backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict(), norms


@pytest.fixture(scope="module")
def reference():
    init = initial_state()
    data = torch.randint(0, 50, (STEPS, BATCH, 17), generator=torch.Generator().manual_seed(1))
    losses, state, _ = single_process(init, data)
    return init, data, losses, state


def _same_state(state, ref_state, who):
    assert list(state) == list(ref_state)  # whole model, own names
    assert_equivalent(state, ref_state, who)


def hybrid_rank(pp, tp, dp, init, data, max_norm, make_opt, schedule, on_step, device, config):
    """One rank of ``train_hybrid`` (module level: ``processes=True`` pickles it)."""
    r = config.rank
    net = new_model(init).to(device)
    model = HybridShardedModel(
        net,
        config,
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        data_parallel_size=-1,
        micro_batch_count=2,
        schedule=schedule,
    )
    opt = HybridShardedOptimizer(make_opt(model.parameters()), config)
    per, d = BATCH // model.data_parallel_size, model.data_parallel_rank
    losses, norms = [], []
    for s in range(STEPS):
        if on_step is not None:
            on_step(r, s)
        part = data[s, d * per : (d + 1) * per].to(device)
        if max_norm is None:
            losses.append(model.train_on_batch(part[:, :-1], part[:, 1:]))
        else:  # the torchtitan order: forward/backward, clip, step
            losses.append(model.forward_backward(part[:, :-1], part[:, 1:]))
            norms.append(float(model.clip_grad_norm_(max_norm)))
            opt.step()
            opt.zero_grad()
    return losses, model.state_dict(), str(model), norms


def train_hybrid(
    pp,
    tp,
    dp,
    init,
    data,
    servers=2,
    max_norm=None,
    make_opt=adamw,
    schedule="1f1b",
    local_calls=True,
    on_step=None,
    device="cpu",
    processes=False,
):
    """``local_calls=False``: activations, partial sums and the ZeRO traffic all cross gRPC
    (else ranks call the servers of their own process directly). ``on_step(rank, step)`` runs
    as each rank begins each step. The model takes the dtype of ``init`` and lives on
    ``device`` (tests/test_cuda.py: "cuda"), its batches too. ``processes``: the ranks are
    spawned processes (LocalCluster(processes=True)), not threads."""
    cluster = LocalCluster(
        pp * tp * dp,
        servers,
        processes=processes,
        run_timeout_s=600,
        server_options={"local_calls": local_calls},
        job=f"hybrid-{uuid.uuid4().hex[:6]}",
        timeout_s=60.0,
    )
    with cluster:
        assert local_calls or not set(cluster.addresses) & local_servers.addresses()  # no shortcut
        args = (pp, tp, dp, init, data, max_norm, make_opt, schedule, on_step, device)
        return cluster.run(partial(hybrid_rank, *args))


@equivalence
@pytest.mark.slow
@pytest.mark.parametrize(
    "pp,tp,dp", [(2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]
)
def test_equals_single_process(reference, pp, tp, dp):
    init, data, ref_losses, ref_state = reference
    results = train_hybrid(pp, tp, dp, init, data)
    for r, (losses, state, described, _) in enumerate(results):
        assert described.endswith(f"Rank({r})")
        assert_equivalent(losses, ref_losses, f"rank {r} losses")
        _same_state(state, ref_state, f"rank {r}")


@equivalence
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_over_the_wire_with_a_server_per_rank(reference, schedule):
    """(2, 2, 2) with one server per rank and every call through gRPC: each group's traffic
    on its members' own servers, as on a cluster."""
    init, data, ref_losses, ref_state = reference
    results = train_hybrid(2, 2, 2, init, data, servers=8, schedule=schedule, local_calls=False)
    for r, (losses, state, _, _) in enumerate(results):
        assert_equivalent(losses, ref_losses, f"rank {r} losses")
        _same_state(state, ref_state, f"rank {r}")


@equivalence
@pytest.mark.slow
@pytest.mark.parametrize("pp,tp,dp", [(2, 1, 1), (2, 2, 2)])
def test_interleaved_schedule_equals_single_process(reference, pp, tp, dp):
    """Interleaved 1F1B: 2 chunks per rank (blocks 0 and 2 on stage 0, 1 and 3 on stage 1)."""
    init, data, ref_losses, ref_state = reference
    results = train_hybrid(pp, tp, dp, init, data, schedule="interleaved_1f1b")
    for r, (losses, state, _, _) in enumerate(results):
        assert_equivalent(losses, ref_losses, f"rank {r} losses")
        _same_state(state, ref_state, f"rank {r}")


@equivalence
@pytest.mark.slow
@pytest.mark.parametrize(
    "pp,tp,dp", [(2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]
)
def test_clipping_equals_single_process(reference, pp, tp, dp):
    """The global norm counts every parameter once: tensor-parallel parts summed, replicated
    tensors and the tied embedding's two copies once; clipped training stays equal.

    SGD with momentum, not Adam: Adam's update hardly depends on the gradient's scale, so it
    would hide a wrong clip coefficient; SGD's step is proportional to it."""
    init, data, _, _ = reference
    ref_losses, ref_state, ref_norms = single_process(init, data, MAX_NORM, sgd)
    assert min(ref_norms) > MAX_NORM  # clipping is active at every step
    for r, (losses, state, _, norms) in enumerate(
        train_hybrid(pp, tp, dp, init, data, max_norm=MAX_NORM, make_opt=sgd)
    ):
        assert_equivalent(norms, ref_norms, f"rank {r} norms")
        assert_equivalent(losses, ref_losses, f"rank {r} losses")
        _same_state(state, ref_state, f"rank {r}")


def test_sizes_must_multiply_to_the_world():
    client = ShardClient(ClusterSpec(["127.0.0.1:1"]), rank=0, world_size=6)
    config = ShardingConfiguration(client, job="x")
    with pytest.raises(ValueError, match=r"\(2\).*\(2\).*\(2\).*6"):
        HybridShardedModel(GPT(CFG), config, 2, 2, 2)


def test_tensor_parallelism_of_an_unknown_model_needs_a_plan():
    client = ShardClient(ClusterSpec(["127.0.0.1:1"]), rank=0, world_size=2)
    config = ShardingConfiguration(client, job="x")
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"no tensor-parallel plan is known for Sequential"):
        HybridShardedModel(seq, config, 1, 2, 1)


@equivalence
@pytest.mark.slow
def test_sequential_model_over_pipeline_and_data():
    """The docstring's other model: an nn.Sequential cut into 2 stages, 2 data-parallel
    replicas, MSE on float targets; equal to single-process training."""
    torch.manual_seed(5)

    def net():
        return torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)
        ).double()

    init = net().state_dict()
    xs = torch.randn(STEPS, 8, 6, dtype=torch.float64)
    ys = torch.randn(STEPS, 8, 3, dtype=torch.float64)
    ref = net()
    ref.load_state_dict(init)
    opt = sgd(ref.parameters())
    ref_losses = []
    for s in range(STEPS):
        loss = torch.nn.functional.mse_loss(ref(xs[s]), ys[s])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())

    nodes = [ShardServer().start() for _ in range(4)]
    run, job = uuid.uuid4().hex[:6], f"seq-{uuid.uuid4().hex[:6]}"

    def rank(r):
        client = ShardClient(
            ClusterSpec([n.address for n in nodes]), rank=r, world_size=4, run_id=run
        )
        config = ShardingConfiguration(client, job=job)
        model = net()
        model.load_state_dict(init)
        model = HybridShardedModel(model, config, 2, 1, 2, micro_batch_count=2)
        HybridShardedOptimizer(sgd(model.parameters()), config)
        per, d = 8 // model.data_parallel_size, model.data_parallel_rank
        losses = [
            model.train_on_batch(xs[s, d * per : (d + 1) * per], ys[s, d * per : (d + 1) * per])
            for s in range(STEPS)
        ]
        return losses, model.state_dict()

    try:
        with ThreadPoolExecutor(4) as pool:
            results = [f.result(timeout=300) for f in [pool.submit(rank, r) for r in range(4)]]
    finally:
        for n in nodes:
            n.stop()
    for r, (losses, state) in enumerate(results):
        assert_equivalent(losses, ref_losses, f"rank {r} losses")
        _same_state(state, ref.state_dict(), f"rank {r}")


def test_kernel_options_warn_once_at_the_callers_line():
    """``foreach=True`` changes nothing on the servers: building the hybrid optimizer says so
    once, at the line that built it (it used to name a line inside paramshard: its inner
    ZeRO-1 optimizer's, which warns for the same torch optimizer)."""
    server = ShardServer().start()
    client = ShardClient(ClusterSpec([server.address]), rank=0, world_size=1)
    try:
        config = ShardingConfiguration(client, job=f"warn-{uuid.uuid4().hex[:6]}")
        model = HybridShardedModel(GPT(CFG), config, 1, 1, 1)
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        with pytest.warns(UserWarning, match=r"AdamW\(foreach=True\) is ignored") as got:
            HybridShardedOptimizer(adamw, config)
        assert [w.filename for w in got if "is ignored" in str(w.message)] == [__file__]
    finally:
        client.close()
        server.stop(grace=None)
