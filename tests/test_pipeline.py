"""Pipeline parallelism: schedules as step lists, partitions of the example GPT, and the
pipeline against its plain PyTorch twin (loss, gradients, AdamW training, gathered state
dict): float64 on both sides, within 1e-9 per tensor (tests/numerics.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from numerics import assert_equivalent
from torch import nn

from paramshard.models.gpt import GPT, GPTConfig, lm_loss
from paramshard.strategies.config import ShardingConfiguration
from paramshard.strategies.pipeline import (
    PipelineParallelModel,
    balanced_partition,
    default_split_points,
    plan_stages,
)
from paramshard.strategies.pipeline.schedules import (
    build_schedule,
    gpipe_schedule,
    one_f_one_b_schedule,
    peak_live_activations,
    theoretical_bubble_fraction,
)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Ranks are threads of one process: one torch thread each, so they do not oversubscribe
    the cores (OpenMP spin-waits make a loaded machine 100x slower otherwise)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- schedules ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_schedule_runs_each_micro_batch_once_forward_before_backward(name, p, m):
    for stage in range(p):
        steps = build_schedule(name, p, stage, m)
        assert sorted(i for k, i, _ in steps if k == "F") == list(range(m))
        assert sorted(i for k, i, _ in steps if k == "B") == list(range(m))
        for i in range(m):
            assert steps.index(("F", i, 0)) < steps.index(("B", i, 0))
        # neighbours exchange tensors in micro-batch order: forwards and backwards ascend
        assert [i for k, i, _ in steps if k == "F"] == list(range(m))
        assert [i for k, i, _ in steps if k == "B"] == list(range(m))


def simulate(name, p, m, v=1):
    """Runs every rank's schedule against FIFO mailboxes (one per sender, receiver and tag,
    as the servers keep them), picking any rank that can go on; fails on a deadlock or when a
    receiver would take another (chunk, micro-batch)'s tensor than it expects. Returns the
    order in which (virtual stage, micro-batch) forwards ran."""
    from collections import deque

    schedules = [build_schedule(name, p, r, m, v) for r in range(p)]
    at = [0] * p
    boxes: dict = {}
    ran = []
    last = p * v - 1
    while any(at[r] < len(schedules[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if at[r] == len(schedules[r]):
                continue
            kind, i, c = schedules[r][at[r]]
            k = c * p + r
            if kind == "F":
                needs = None if k == 0 else ((r - 1) % p, r, "act")
                expect, sends = (k - 1, i), (None if k == last else (r, (r + 1) % p, "act"))
            else:
                needs = None if k == last else ((r + 1) % p, r, "grad")
                expect, sends = (k + 1, i), (None if k == 0 else (r, (r - 1) % p, "grad"))
            if needs is not None:
                box = boxes.get(needs)
                if not box:
                    continue
                assert box.popleft() == expect, (name, p, m, v, r, kind, i, c)
            if sends is not None:
                boxes.setdefault(sends, deque()).append((k, i))
            if kind == "F":
                ran.append((k, i))
            at[r] += 1
            progressed = True
        assert progressed, f"{name} p={p} m={m} v={v} deadlocks at {at}"
    assert all(not b for b in boxes.values())
    return ran


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_plain_schedules_pass_every_tensor_in_order(p, m):
    for name in ("gpipe", "1f1b"):
        simulate(name, p, m)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("mult", [1, 2, 3])
def test_interleaved_schedule_runs_without_deadlock_in_order(p, v, mult):
    m = p * mult
    ran = simulate("interleaved_1f1b", p, m, v)
    assert sorted(ran) == [(k, i) for k in range(p * v) for i in range(m)]
    for r in range(p):
        steps = build_schedule("interleaved_1f1b", p, r, m, v)
        for i in range(m):
            for c in range(v):
                assert steps.index(("F", i, c)) < steps.index(("B", i, c))


def test_interleaved_schedule_shape_and_errors():
    # Megatron's warm-up: 2 (p - rank - 1) + (v - 1) p forwards, then 1F1B
    steps = build_schedule("interleaved_1f1b", 2, 0, 4, 2)
    assert steps[:5] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0)]
    assert steps[5] == ("B", 0, 1)  # backwards start with the last chunk
    assert theoretical_bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    with pytest.raises(ValueError, match=r"micro_batch_count \(3\) divisible.*\(2\)"):
        build_schedule("interleaved_1f1b", 2, 0, 3, 2)
    with pytest.raises(ValueError, match="one chunk per rank"):
        build_schedule("1f1b", 2, 0, 4, 2)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_1f1b_bounds_live_activations(p, m):
    for stage in range(p):
        assert peak_live_activations(one_f_one_b_schedule(p, stage, m)) == min(p - stage, m)
        assert peak_live_activations(gpipe_schedule(p, stage, m)) == m


def test_1f1b_shape():
    assert one_f_one_b_schedule(4, 0, 6)[:4] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)]
    assert one_f_one_b_schedule(4, 3, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                                             ("B", 2)]  # fmt: skip
    assert theoretical_bubble_fraction(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match="schedule must be one of gpipe, 1f1b, interleaved"):
        build_schedule("zigzag", 2, 0, 2)  # type: ignore[arg-type]


# -- partitions --------------------------------------------------------------------------------


def test_balanced_partition_minimises_the_largest_stage():
    assert balanced_partition([5, 1, 1, 1, 1, 5], 3) == [range(0, 1), range(1, 5), range(5, 6)]
    parts = balanced_partition([3, 1, 4, 1, 5, 9, 2, 6], 3)
    assert [r.start for r in parts] == [0, *[r.stop for r in parts[:-1]]]
    assert max(sum([3, 1, 4, 1, 5, 9, 2, 6][r.start : r.stop]) for r in parts) == 14


def _blocks_per_stage(model, p, partition="uniform"):
    plan = plan_stages(model, default_split_points(model, p, partition))
    n = len(model.blocks)
    return [[i for i in range(n) if plan.stage_of(f"blocks.{i}") == s] for s in range(p)]


@pytest.mark.parametrize("partition", ["uniform", "balanced"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_default_split_points_cover_every_block_once(partition, p):
    model = GPT(GPTConfig.tiny(vocab_size=50, n_layer=6))
    stages = _blocks_per_stage(model, p, partition)
    assert [b for s in stages for b in s] == list(range(6))
    plan = plan_stages(model, default_split_points(model, p, partition))
    assert plan.units["wte"] == plan.units["wpe"] == 0
    assert plan.units["ln_f"] == plan.units["lm_head"] == p - 1
    assert plan.units["drop"] == -1  # no parameters: every stage runs it
    if partition == "uniform":
        assert [len(s) for s in stages] == [len(r) for r in _even(6, p)]


def _even(n, p):
    return [range(n // p + (1 if s < n % p else 0)) for s in range(p)]


def test_balanced_gives_the_end_stages_fewer_blocks():
    # a large vocabulary makes embedding and head heavy: end stages get fewer blocks
    model = GPT(GPTConfig.tiny(vocab_size=2000, n_layer=8))
    counts = [len(s) for s in _blocks_per_stage(model, 4, "balanced")]
    assert sum(counts) == 8 and counts[0] < counts[1] and counts[-1] < counts[1]


def test_split_errors_name_the_numbers():
    model = GPT(GPTConfig.tiny(n_layer=2))
    with pytest.raises(ValueError, match="2 blocks, 3 stages"):
        default_split_points(model, 3)
    with pytest.raises(ValueError, match="partition must be one of uniform, balanced"):
        default_split_points(model, 2, "random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split point 'blocks.9' is not a module of GPT"):
        plan_stages(model, ["blocks.9"])
    with pytest.raises(ValueError, match="must follow the model's module order"):
        plan_stages(GPT(GPTConfig.tiny(n_layer=4)), ["blocks.3", "blocks.1"])
    with pytest.raises(ValueError, match="split point 'blocks' contains split point 'blocks.1'"):
        plan_stages(model, ["blocks", "blocks.1"])


def test_sequential_is_its_own_block_container():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    assert default_split_points(model, 2) == ["2"]
    plan = plan_stages(model, ["2"])
    assert plan.units == {"0": 0, "1": -1, "2": 1, "3": 1}  # the ReLU runs on every stage


# -- the pipeline against a single process -----------------------------------------------------

B, T, M = 8, 16, 4


def _reference_and_batches(steps: int, n_layer: int = 4, seed: int = 0):
    """A float64 GPT (both sides of every comparison) and ``steps`` batches of tokens."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig.tiny(vocab_size=50, bias=False, n_layer=n_layer)).double()
    g = torch.Generator().manual_seed(seed + 1)
    batches = [
        (torch.randint(0, 50, (B, T), generator=g), torch.randint(0, 50, (B, T), generator=g))
        for _ in range(steps)
    ]
    return model, batches


@pytest.mark.equivalence
@pytest.mark.parametrize(
    ("pp", "schedule", "partition"),
    [
        (2, "gpipe", "uniform"),
        (2, "1f1b", "balanced"),
        (3, "1f1b", "uniform"),
        (4, "gpipe", "balanced"),
        (4, "1f1b", "uniform"),
        (2, "interleaved_1f1b", "uniform"),
        (2, "interleaved_1f1b", "balanced"),
    ],
)
def test_loss_and_gradients_equal_single_process(servers, run_ranks, pp, schedule, partition):
    ref, [(x, y)] = _reference_and_batches(1)
    initial = copy.deepcopy(ref)
    loss_ref = lm_loss(ref(x), y)
    loss_ref.backward()
    addresses = [s.address for s in servers(2)]

    def rank(client):
        model = PipelineParallelModel(
            copy.deepcopy(initial),
            ShardingConfiguration(client),
            micro_batch_count=M,
            partition=partition,
            schedule=schedule,
        )
        loss = model.train_step(x, y)
        return loss, model.gather_full_grads(), model.last_peak_activations, model.steps

    results = run_ranks(rank, pp, addresses)
    want_grads = {name: p.grad for name, p in ref.named_parameters()}
    for stage, (loss, grads, peak, steps) in enumerate(results):
        assert_equivalent(loss, loss_ref.item(), f"stage {stage} loss")
        if schedule == "interleaved_1f1b":  # v = 2 chunks of micro-batches
            assert peak == peak_live_activations(steps) <= 2 * M
        else:
            assert peak == (M if schedule == "gpipe" else min(pp - stage, M))
        assert_equivalent({k: grads[k] for k in want_grads}, want_grads, f"stage {stage} grads")


@pytest.mark.equivalence
@pytest.mark.parametrize(("pp", "schedule"), [(2, "1f1b"), (3, "gpipe"), (2, "interleaved_1f1b")])
def test_adamw_training_equals_single_process(servers, run_ranks, pp, schedule):
    steps = 5
    ref, batches = _reference_and_batches(steps)
    initial = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(ref(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    addresses = [s.address for s in servers(2)]

    def rank(client):
        model = PipelineParallelModel(
            copy.deepcopy(initial), ShardingConfiguration(client), M, schedule=schedule
        )
        stage_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for x, y in batches:
            stage_opt.zero_grad(set_to_none=True)
            losses.append(model.train_step(x, y))
            stage_opt.step()
        return losses, model.gather_full_state_dict()

    results = run_ranks(rank, pp, addresses)
    expected = ref.state_dict()
    for stage, (losses, state) in enumerate(results):
        assert_equivalent(losses, ref_losses, f"stage {stage} losses")
        assert list(state) == list(expected)
        assert_equivalent(state, expected, f"stage {stage}")
        # the last stage's copy of the tied weight stayed equal to the embedding
        torch.testing.assert_close(state["lm_head.weight"], state["wte.weight"], rtol=0, atol=0)


def test_gather_full_state_dict_equals_the_model(servers, run_ranks):
    ref, _ = _reference_and_batches(0)
    addresses = [s.address for s in servers(1)]

    def rank(client):
        model = PipelineParallelModel(copy.deepcopy(ref), ShardingConfiguration(client), 2)
        return model.stage_state_dict(), model.gather_full_state_dict()

    results = run_ranks(rank, 3, addresses)
    expected = ref.state_dict()
    assert sorted(k for stage, _ in results for k in stage) == sorted(expected)
    for _, full in results:
        assert list(full) == list(expected)
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0)


@pytest.mark.equivalence
def test_pipeline_groups_inside_a_larger_world(servers, run_ranks):
    """Two independent pipelines of 2 stages in a world of 4 (pp_client = a subgroup)."""
    ref, [(x, y)] = _reference_and_batches(1)
    initial = copy.deepcopy(ref)
    lm_loss(ref(x), y).backward()
    addresses = [s.address for s in servers(2)]

    def rank(client):
        members = [0, 1] if client.rank < 2 else [2, 3]
        pp = client.subgroup(members, f"pp{members[0]}")
        model = PipelineParallelModel(
            copy.deepcopy(initial), ShardingConfiguration(client), M, pp_client=pp
        )
        model.train_step(x, y)
        return model.gather_full_grads()

    want = {name: p.grad for name, p in ref.named_parameters()}
    for r, grads in enumerate(run_ranks(rank, 4, addresses)):
        assert_equivalent({k: grads[k] for k in want}, want, f"rank {r} grads")


def test_bad_batch_and_micro_batch_count(servers, run_ranks):
    ref, _ = _reference_and_batches(0)
    addresses = [s.address for s in servers(1)]

    def rank(client):
        config = ShardingConfiguration(client)
        with pytest.raises(ValueError, match="micro_batch_count must be an int >= 1, got 0"):
            PipelineParallelModel(copy.deepcopy(ref), config, 0)
        model = PipelineParallelModel(copy.deepcopy(ref), config, 3)
        with pytest.raises(ValueError, match="batch size 8 of x is not divisible by"):
            model.train_step(torch.zeros(8, 4, dtype=torch.long), torch.zeros(8, 4).long())

    run_ranks(rank, 1, addresses)


def test_interleaved_ranks_hold_every_pth_chunk(servers, run_ranks):
    """p = 2, v = 2 over 4 blocks: rank 0 runs blocks 0 and 2 (with the embedding), rank 1
    blocks 1 and 3 (with ln_f and the head); parameters() covers both chunks once."""
    ref, _ = _reference_and_batches(0)
    addresses = [s.address for s in servers(1)]

    def rank(client):
        model = PipelineParallelModel(
            copy.deepcopy(ref), ShardingConfiguration(client), 4, schedule="interleaved_1f1b"
        )
        names = {n for n, _ in model.named_parameters()}
        blocks = [u.split(".")[1] for u in model.units if u.startswith("blocks.")]
        return blocks, model.virtual_stages, len(names), model.paper_bubble_ratio

    (b0, v0, n0, r0), (b1, v1, n1, _) = run_ranks(rank, 2, addresses)
    assert (b0, b1, v0, v1) == (["0", "2"], ["1", "3"], 2, 2)
    assert r0 == pytest.approx(1 / 8)  # (p - 1) / (v m)
    tied_copy = 1  # the last rank's own lm_head copy of the embedding
    assert n0 + n1 == len(list(ref.parameters())) + tied_copy


def test_partition_and_schedule_names_are_lenient():
    from paramshard.strategies import LoadBalancedPartitionStrategy, UniformPartitionStrategy
    from paramshard.strategies.pipeline import partition_name, schedule_name

    for given in ("balanced", "load_balanced", "Load-Balanced", LoadBalancedPartitionStrategy):
        assert partition_name(given) == "balanced"
    assert partition_name(LoadBalancedPartitionStrategy()) == "balanced"
    assert partition_name(UniformPartitionStrategy) == "uniform"
    for given, want in [("GPipe", "gpipe"), ("1F1B", "1f1b"), ("interleaved", "interleaved_1f1b")]:
        assert schedule_name(given) == want
    with pytest.raises(ValueError, match="partition must be one of uniform, balanced"):
        partition_name("random")
    model = GPT(GPTConfig.tiny(n_layer=4))
    a = default_split_points(model, 2, "load-balanced")
    assert a == default_split_points(model, 2, LoadBalancedPartitionStrategy())
