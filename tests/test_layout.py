"""Layout (model -> units -> flat buffers), planned on the example GPT (its own tests:
tests/test_gpt_model.py)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn

from paramshard.models.gpt import (
    GPT,
    Block,
    GPTConfig,
)
from paramshard.protos.slicing import slice_bounds
from paramshard.strategies.layout import (
    ROOT,
    buffers_from_manifest,
    flat_views,
    flatten,
    manifest,
    plan_buffers,
    plan_units,
    unflatten_into,
)


def tiny_gpt(seed: int = 0, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny(**overrides))


# --- units -----------------------------------------------------------------------------------


def test_units_of_gpt_are_root_then_blocks() -> None:
    model = tiny_gpt(n_layer=3)
    units = plan_units(model, wrap=(Block,))
    assert [name for name, _ in units] == [ROOT, "blocks.0", "blocks.1", "blocks.2"]
    assert units[0][1] is model and units[2][1] is model.blocks[1]
    assert [name for name, _ in plan_units(model)] == [ROOT]


def _torch_size_policy_units(model: nn.Module, min_params: int) -> set[str]:
    """Which modules torch's own FSDP size-based policy would wrap (the twin)."""
    from torch.distributed.fsdp.wrap import _recursive_wrap, size_based_auto_wrap_policy

    wrapped: set[int] = set()

    def record(module: nn.Module) -> nn.Module:
        wrapped.add(id(module))
        return module

    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=min_params)
    _recursive_wrap(model, policy, record, set(), set(), only_wrap_children=True)
    return {name for name, m in model.named_modules() if name and id(m) in wrapped}


@pytest.mark.parametrize("min_params", [1, 100, 2_000, 10_000, 40_000, 60_000, 10**6])
def test_size_policy_matches_torch(min_params: int) -> None:
    model = tiny_gpt(tie_weights=False)
    units = plan_units(model, min_params=min_params)
    assert units[0][0] == ROOT
    assert {name for name, _ in units[1:]} == _torch_size_policy_units(model, min_params)


def test_size_policy_wraps_blocks_not_the_list() -> None:
    model = tiny_gpt()
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    names = [name for name, _ in plan_units(model, min_params=block_numel)]
    assert names == [ROOT, "blocks.0", "blocks.1"]


def test_small_modules_below_floor_are_not_units() -> None:
    model = tiny_gpt()
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    units = plan_units(model, wrap=(Block,), min_unit_params=block_numel + 1)
    assert [name for name, _ in units] == [ROOT]


def test_submodule_named_root_is_rejected() -> None:
    model = nn.Sequential()
    model.add_module("root", nn.Linear(2, 2))
    with pytest.raises(ValueError, match="'root'"):
        plan_units(model, wrap=(nn.Linear,))


# --- buffers ---------------------------------------------------------------------------------


def test_tied_weight_is_in_one_buffer_in_root() -> None:
    model = tiny_gpt()
    buffers = plan_buffers(model, plan_units(model, wrap=(Block,)))
    assert [b.name for b in buffers] == ["root#g0", "blocks.0#g0", "blocks.1#g0"]
    all_names = [e.name for b in buffers for e in b.entries]
    assert sorted(all_names) == sorted(n for n, _ in model.named_parameters())
    assert [e.name for e in buffers[0].entries] == [
        "wte.weight",
        "wpe.weight",
        "ln_f.weight",
        "ln_f.bias",
    ]
    assert sum(b.numel for b in buffers) == model.num_params()
    held = [id(p) for b in buffers for p in b.params]
    assert len(held) == len(set(held)) and id(model.wte.weight) in held


class _Shared(nn.Module):
    """Two blocks sharing one Linear, plus a weight tied inside a single block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(2)
        )
        self.blocks[1][0] = self.blocks[0][0]  # shared across units -> root
        self.blocks[1][1].weight = self.blocks[1][0].weight  # used from both units too
        self.head = nn.Linear(4, 4)


def test_shared_parameters_go_to_common_ancestor() -> None:
    model = _Shared()
    units = plan_units(model, wrap=(nn.Sequential,))
    assert [n for n, _ in units] == [ROOT, "blocks.0", "blocks.1"]
    by_unit = {b.unit: [e.name for e in b.entries] for b in plan_buffers(model, units)}
    assert by_unit == {
        ROOT: ["blocks.0.0.weight", "blocks.0.0.bias", "head.weight", "head.bias"],
        "blocks.0": ["blocks.0.1.weight", "blocks.0.1.bias"],
        "blocks.1": ["blocks.1.1.bias"],
    }


def test_weight_tied_within_one_unit_stays_there() -> None:
    inner = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    inner[1].weight = inner[0].weight
    model = nn.Sequential(nn.Linear(3, 3), inner)
    buffers = plan_buffers(model, plan_units(model, wrap=(nn.Sequential,)))
    assert {b.name: [e.name for e in b.entries] for b in buffers} == {
        "root#g0": ["0.weight", "0.bias"],
        "1#g0": ["1.0.weight"],
    }


def weight_decay_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    """Decay on matrices; none on biases and LayerNorm weights."""
    params = list(model.parameters())
    return [[p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]]


def test_two_param_groups_give_two_buffers_per_unit() -> None:
    model = tiny_gpt()
    buffers = plan_buffers(model, plan_units(model, wrap=(Block,)), weight_decay_groups(model))
    assert [b.name for b in buffers] == [
        "root#g0",
        "root#g1",
        "blocks.0#g0",
        "blocks.0#g1",
        "blocks.1#g0",
        "blocks.1#g1",
    ]
    by_name = {b.name: [e.name for e in b.entries] for b in buffers}
    assert by_name["root#g0"] == ["wte.weight", "wpe.weight"]
    assert by_name["root#g1"] == ["ln_f.weight", "ln_f.bias"]
    prefix = "blocks.1."
    assert by_name["blocks.1#g0"] == [
        prefix + n
        for n in [
            "attn.c_attn.weight",
            "attn.c_proj.weight",
            "mlp.c_fc.weight",
            "mlp.c_proj.weight",
        ]
    ]
    assert by_name["blocks.1#g1"] == [
        prefix + n
        for n in [
            "ln_1.weight",
            "ln_1.bias",
            "attn.c_attn.bias",
            "attn.c_proj.bias",
            "ln_2.weight",
            "ln_2.bias",
            "mlp.c_fc.bias",
            "mlp.c_proj.bias",
        ]
    ]
    # An optimizer's own param_groups (dicts) plan the same buffers.
    optimizer = torch.optim.AdamW(model.param_groups(weight_decay=0.1))
    same = plan_buffers(model, plan_units(model, wrap=(Block,)), optimizer.param_groups)
    assert manifest(same) == manifest(buffers)


def test_group_with_no_params_in_a_unit_makes_no_buffer() -> None:
    model = tiny_gpt()
    groups = [[model.wte.weight], [p for p in model.parameters() if p is not model.wte.weight]]
    names = [b.name for b in plan_buffers(model, plan_units(model, wrap=(Block,)), groups)]
    assert names == ["root#g0", "root#g1", "blocks.0#g1", "blocks.1#g1"]


def test_offsets_are_contiguous_and_shapes_match() -> None:
    model = tiny_gpt()
    named = dict(model.named_parameters())
    for b in plan_buffers(model, plan_units(model, wrap=(Block,)), weight_decay_groups(model)):
        offset = 0
        for e, p in zip(b.entries, b.params, strict=True):
            assert e.offset == offset and e.numel == p.numel()
            assert e.shape == tuple(p.shape) and e.dtype == "float32"
            assert named[e.name] is p
            offset += e.numel
        assert b.numel == offset


def test_frozen_parameters_are_skipped() -> None:
    model = tiny_gpt()
    model.wpe.weight.requires_grad_(False)
    buffers = plan_buffers(model, plan_units(model, wrap=(Block,)), weight_decay_groups(model))
    assert "wpe.weight" not in [e.name for b in buffers for e in b.entries]


def test_parameter_missing_from_groups_is_named() -> None:
    model = tiny_gpt()
    decay, no_decay = weight_decay_groups(model)
    no_decay = [p for p in no_decay if p is not model.ln_f.bias]
    with pytest.raises(ValueError, match=r"'ln_f\.bias' is in no param group"):
        plan_buffers(model, plan_units(model), [decay, no_decay])


def test_parameter_in_two_groups_is_named() -> None:
    model = tiny_gpt()
    decay, no_decay = weight_decay_groups(model)
    with pytest.raises(ValueError, match=r"'wpe\.weight' is in param groups 0 and 1"):
        plan_buffers(model, plan_units(model), [decay, [*no_decay, model.wpe.weight]])


def test_foreign_tensor_in_a_group_is_rejected() -> None:
    model = tiny_gpt()
    groups = [list(model.parameters()), [nn.Parameter(torch.zeros(2, 3))]]
    with pytest.raises(ValueError, match=r"param group 1 .*\(2, 3\)"):
        plan_buffers(model, plan_units(model), groups)


def test_units_must_come_from_the_model() -> None:
    model, other = tiny_gpt(), tiny_gpt()
    with pytest.raises(ValueError, match="root unit"):
        plan_buffers(model, plan_units(other))
    with pytest.raises(ValueError, match="'blocks.0'"):
        plan_buffers(model, [(ROOT, model), ("blocks.0", other.blocks[0])])


# --- flat tensors ----------------------------------------------------------------------------


def test_flatten_unflatten_round_trip_is_exact() -> None:
    model = tiny_gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for b in plan_buffers(model, plan_units(model, wrap=(Block,)), weight_decay_groups(model)):
        flat = flatten(b.params, b.numel)
        assert flat.shape == (b.numel,) and flat.dtype == torch.float32
        for p in b.params:
            p.data.zero_()
        unflatten_into(flat, b.entries, b.params)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_flatten_checks_numel() -> None:
    with pytest.raises(ValueError, match="expects 7"):
        flatten([torch.ones(2, 3)], 7)
    with pytest.raises(ValueError, match="more than the 5"):
        flatten([torch.ones(2, 3)], 5)


def test_flatten_casts_and_unflatten_casts_back() -> None:
    tensors = [torch.randn(3, 2, dtype=torch.bfloat16), torch.randn(4, dtype=torch.bfloat16)]
    flat = flatten(tensors, 10)
    assert flat.dtype == torch.float32
    out = [torch.empty_like(t) for t in tensors]
    model = nn.Module()
    model.a, model.b = nn.Parameter(tensors[0]), nn.Parameter(tensors[1])
    [buffer] = plan_buffers(model, plan_units(model))
    assert [e.dtype for e in buffer.entries] == ["bfloat16", "bfloat16"]
    unflatten_into(flat, buffer.entries, out)
    assert all(torch.equal(a, b) for a, b in zip(out, tensors, strict=True))
    with pytest.raises(ValueError, match="'a' has shape"):
        unflatten_into(flat, buffer.entries, [torch.empty(6), out[1]])


def test_flat_views_share_memory() -> None:
    model = tiny_gpt()
    buffer = plan_buffers(model, plan_units(model, wrap=(Block,)))[1]
    flat = torch.zeros(buffer.numel)
    views = flat_views(flat, buffer.entries)
    assert [tuple(v.shape) for v in views] == [e.shape for e in buffer.entries]
    views[2].fill_(7.0)
    e = buffer.entries[2]
    assert torch.all(flat[e.offset : e.offset + e.numel] == 7.0)
    assert flat.sum() == 7.0 * e.numel
    with pytest.raises(ValueError, match="entries need"):
        flat_views(torch.zeros(3), buffer.entries)


# --- manifest --------------------------------------------------------------------------------


def test_manifest_rebuilds_full_tensors_from_slices() -> None:
    """What export does: servers hold slices and the manifest; no model code needed."""
    model = tiny_gpt()
    buffers = plan_buffers(model, plan_units(model, wrap=(Block,)), weight_decay_groups(model))
    described = json.loads(json.dumps(manifest(buffers)))
    num_servers = 3
    slices = {
        b.name: [
            flatten(b.params, b.numel)[slice(*slice_bounds(b.numel, num_servers, i))]
            for i in range(num_servers)
        ]
        for b in buffers
    }

    rebuilt = {}
    for spec in buffers_from_manifest(described):
        flat = torch.cat(slices[spec.name])
        assert flat.numel() == spec.numel
        for entry, view in zip(spec.entries, flat_views(flat, spec.entries), strict=True):
            rebuilt[entry.name] = view.to(getattr(torch, entry.dtype))
    expected = dict(model.named_parameters())
    assert rebuilt.keys() == expected.keys()
    assert all(torch.equal(rebuilt[n], expected[n]) for n in expected)
    assert [
        (b.name, b.unit, b.group_index, b.entries) for b in buffers_from_manifest(described)
    ] == [(b.name, b.unit, b.group_index, b.entries) for b in buffers]


class _Scaled(nn.Module):
    """A big Linear plus a parameter of its own: size policy makes nested units."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(300))
        self.inner = nn.Linear(20, 20)


def test_nested_units_own_only_what_inner_units_do_not() -> None:
    model = nn.Sequential(nn.Linear(2, 2), _Scaled())
    units = plan_units(model, min_params=300)
    assert [n for n, _ in units] == [ROOT, "1", "1.inner"]
    assert {n for n, _ in units[1:]} == _torch_size_policy_units(model, 300)
    by_unit = {b.unit: [e.name for e in b.entries] for b in plan_buffers(model, units)}
    assert by_unit == {
        ROOT: ["0.weight", "0.bias"],
        "1": ["1.scale"],
        "1.inner": ["1.inner.weight", "1.inner.bias"],
    }
