"""Activation checkpointing and ``torch.compile`` of each block under FSDP and ZeRO-2: each run
equals the same training without them, in float64 at tests/numerics.py's 1e-9.

Checkpointing is non-reentrant (``use_reentrant=False``) in the two places users put it:
- around the block's call, hooks included: torch's ``checkpoint_wrapper`` (torchtitan's
  ``ptd_checkpoint_wrapper``) on each example-GPT block. FSDP's unit hooks then run again when
  backward recomputes the block. With torch's early stop off the recomputation runs the whole
  forward, and the post-forward hook used to free the unit its backward was about to use
  ("size of tensor a (0)"): the strategies now leave a unit recomputed inside backward gathered;
- around the block's ``forward`` only: transformers' ``activation_checkpointing_enable`` on HF
  GPT-2 (its hooks stay outside).
Each test also counts the blocks' MLP calls: twice per step means backward did recompute.

Compiled: each block on its own (torchtitan's form), in place (``block.compile()``, names kept)
and wrapped (``torch.compile(block)`` put back in the ModuleList: names gain ``_orig_mod.``,
stripped to compare). The strategies' hooks are ``eager_hook`` (``torch.compiler.disable``):
before that, dynamo traced FSDP's pre-forward hook and failed. The matrix uses the
``aot_eager`` backend (dynamo and AOTAutograd, ~1-3 s per run); one test runs inductor, which
compiles C++ with the machine's gcc (~20 s cold, marked slow).
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch
from test_hf_float64 import CFG as GPT2_CFG
from test_hf_float64 import batches, train_sharded
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
)

from paramshard.models.gpt import GPT, Block, GPTConfig, lm_loss

transformers = pytest.importorskip("transformers")

STRATEGIES = ("zero2", "fsdp")
WORLD, STEPS = 2, 3
GPT_CFG = GPTConfig.tiny(vocab_size=50, n_embd=36, n_head=2, bias=False)


def gpt_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(tokens[:, :-1]), tokens[:, 1:])


def gpt2_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))


def initial_state(build) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return build().double().state_dict()


# Built here, not in the rank threads: two threads seeding and drawing from torch's one global
# generator at once would each get a mix.
GPT_INIT = initial_state(lambda: GPT(GPT_CFG))
GPT2_INIT = initial_state(lambda: transformers.GPT2LMHeadModel(GPT2_CFG))


def new_gpt(calls: list | None = None) -> GPT:
    net = GPT(GPT_CFG).double()
    net.load_state_dict(GPT_INIT)
    if calls is not None:
        for block in net.blocks:
            block.mlp.register_forward_pre_hook(lambda m, a: calls.append(1))
    return net


def new_gpt2(calls: list | None = None) -> torch.nn.Module:
    net = transformers.GPT2LMHeadModel(GPT2_CFG).double()
    net.load_state_dict(GPT2_INIT)
    if calls is not None:
        for block in net.transformer.h:
            block.mlp.register_forward_pre_hook(lambda m, a: calls.append(1))
    return net


DATA = batches(steps=STEPS, batch=WORLD * 2, seed=3)


@functools.cache
def plain(model: str, strategy: str) -> tuple:
    """The run without checkpointing or compile (computed once per model and strategy)."""
    build, loss = (new_gpt, gpt_loss) if model == "gpt" else (new_gpt2, gpt2_loss)
    wrap = {"wrap": (Block,)} if strategy == "fsdp" and model == "gpt" else {}
    return tuple(train_sharded(strategy, build, DATA, loss, WORLD, **wrap))


def assert_same_as_plain(results: list, model: str, strategy: str, what: str) -> None:
    from numerics import assert_equivalent

    want = plain(model, strategy)
    for r, ((losses, state), (ref_losses, ref_state)) in enumerate(zip(results, want, strict=True)):
        named = {k.replace("_orig_mod.", ""): v for k, v in state.items()}
        assert_equivalent(losses, ref_losses, f"{what} rank {r} losses")
        assert_equivalent(named, ref_state, f"{what} rank {r}")


# -- activation checkpointing -----------------------------------------------------------------
@pytest.mark.equivalence
@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "full-recompute"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_wrapper_on_blocks_equals_plain(strategy, early_stop, one_torch_thread):
    calls: list = []

    def build() -> GPT:
        net = new_gpt(calls)
        for i, block in enumerate(net.blocks):
            net.blocks[i] = checkpoint_wrapper(block)  # non-reentrant by default
        return net

    wrap = {"wrap": (Block,)} if strategy == "fsdp" else {}
    setting = torch.utils.checkpoint.set_checkpoint_early_stop(early_stop)
    with setting if not early_stop else contextlib.nullcontext():
        results = train_sharded(strategy, build, DATA, gpt_loss, WORLD, **wrap)
    assert len(calls) == 2 * WORLD * STEPS * GPT_CFG.n_layer  # forward, then recomputed
    assert_same_as_plain(results, "gpt", strategy, f"{strategy} checkpoint_wrapper")


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hf_gradient_checkpointing_equals_plain(strategy, one_torch_thread):
    calls: list = []

    def build() -> torch.nn.Module:
        net = new_gpt2(calls)
        net.activation_checkpointing_enable({"use_reentrant": False})
        return net

    results = train_sharded(strategy, build, DATA, gpt2_loss, WORLD)  # FSDP: GPT2Block units
    assert len(calls) == 2 * WORLD * STEPS * GPT2_CFG.n_layer
    assert_same_as_plain(results, "gpt2", strategy, f"{strategy} HF gradient checkpointing")


# -- torch.compile of each block --------------------------------------------------------------
@pytest.fixture
def fresh_dynamo():
    """Each compile test compiles its own blocks: nothing reused from an earlier test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compile_blocks(blocks: torch.nn.ModuleList, form: str, backend, wrap_first: bool = False):
    """Compiles each block of ``blocks`` on its own: in place, or wrapped and put back."""
    for i in range(len(blocks)):
        if wrap_first:
            blocks[i] = checkpoint_wrapper(blocks[i])
        if form == "in-place":
            blocks[i].compile(backend=backend)
        else:
            blocks[i] = torch.compile(blocks[i], backend=backend)


@pytest.mark.equivalence
@pytest.mark.parametrize("form", ["in-place", "wrapped"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_blocks_equal_plain(strategy, form, one_torch_thread, fresh_dynamo):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def build() -> GPT:
        net = new_gpt()
        compile_blocks(net.blocks, form, counter)
        return net

    wrap = {"wrap": (Block,)} if strategy == "fsdp" else {}
    results = train_sharded(strategy, build, DATA, gpt_loss, WORLD, **wrap)
    assert counter.frame_count > 0 and counter.op_count > 0  # the blocks did compile
    assert_same_as_plain(results, "gpt", strategy, f"{strategy} torch.compile {form}")


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hf_compiled_blocks_with_checkpointing_equal_plain(
    strategy, one_torch_thread, fresh_dynamo
):
    """HF GPT-2: transformers' checkpointing, then each GPT2Block compiled in place. (No call
    counting here: a Python side effect inside a checkpointed region stops dynamo from
    compiling it.)"""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def build() -> torch.nn.Module:
        net = new_gpt2()
        net.activation_checkpointing_enable({"use_reentrant": False})
        compile_blocks(net.transformer.h, "in-place", counter)
        return net

    results = train_sharded(strategy, build, DATA, gpt2_loss, WORLD)
    assert counter.frame_count > 0 and counter.op_count > 0
    assert_same_as_plain(results, "gpt2", strategy, f"{strategy} HF checkpointing + compile")


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_wrapper_then_compile_equals_plain(strategy, one_torch_thread, fresh_dynamo):
    """torchtitan's order: checkpoint_wrapper on each block, then each compiled; FSDP's units
    are the wrapped blocks (``wrap=(CheckpointWrapper,)``, as torchtitan shards them), so its
    hooks stay outside the checkpointed region: dynamo cannot break a graph inside one, and
    would run a region holding them uncompiled."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def build() -> GPT:
        net = new_gpt()
        compile_blocks(net.blocks, "in-place", counter, wrap_first=True)
        return net

    wrap = {"wrap": (CheckpointWrapper,)} if strategy == "fsdp" else {}
    results = train_sharded(strategy, build, DATA, gpt_loss, WORLD, **wrap)
    assert counter.frame_count > 0 and counter.op_count > 0
    assert_same_as_plain(results, "gpt", strategy, f"{strategy} checkpoint_wrapper + compile")


@pytest.mark.slow
@pytest.mark.equivalence
def test_inductor_compiled_blocks_equal_plain(one_torch_thread, fresh_dynamo, monkeypatch):
    """The default backend: inductor generates and compiles C++ for each block (gcc here).

    Inductor's on-disk cache (precompiled headers included) is shared by runs with different
    ``ATEN_CPU_CAPABILITY`` (CI runs this test under AVX-512 and under "default"), and a header
    built for one capability does not compile code generated for the other: one cache per
    capability."""
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.runtime_utils import default_cache_dir

    capability = os.environ.get("ATEN_CPU_CAPABILITY", "native") or "native"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", f"{default_cache_dir()}-{capability}")

    counters.clear()

    def build() -> GPT:
        net = new_gpt()
        compile_blocks(net.blocks, "in-place", "inductor")
        return net

    results = train_sharded("fsdp", build, DATA, gpt_loss, WORLD, wrap=(Block,))
    compiled = (
        counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]
    )
    assert compiled > 0  # inductor's graphs, generated or from its on-disk cache
    assert_same_as_plain(results, "gpt", "fsdp", "fsdp torch.compile inductor")
