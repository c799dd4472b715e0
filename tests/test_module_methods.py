"""A wrapped model is still an ``nn.Module`` to torch: its buffers, ``.to()`` and
``torch.compile`` work on every strategy, as on torch's own DDP and FSDP.

The sharded wrappers (ZeRO-1, ZeRO-2, FSDP) kept their list of flat buffers in ``_buffers``,
the attribute where ``nn.Module`` keeps a module's registered buffers: ``model.buffers()``,
``named_buffers()``, ``.to()``, ``.float()`` and ``torch.compile(model)`` all ended in
"AttributeError: 'list' object has no attribute 'items'" (a newcomer's walkthrough found it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from strategy_world import (
    KINDS,
    addrs_fixture,  # noqa: F401 - the module's servers: ``addrs``
    rank_data,
    world,
)

from paramshard.models.gpt import GPT, lm_loss
from paramshard.strategies import ShardedModelBase

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("kind", KINDS)
def test_module_methods_and_compile_after_a_step(
    kind: str, run_ranks: Any, addrs: list[str]
) -> None:
    def fn(client: Any, model: ShardedModelBase, opt: Any, ref: GPT) -> dict[str, Any]:
        x, y = rank_data(client.rank)
        model.train_on_batch(x, y)
        names = [n for n, _ in model.named_buffers()]
        assert len(list(model.buffers())) == len(names)
        assert names == [f"module.{n}" for n, _ in ref.named_buffers()]
        assert model.to("cpu") is model
        with torch.no_grad():
            eager = lm_loss(model(x), y).item()
            compiled = lm_loss(torch.compile(model, backend="eager")(x), y).item()
        return {"eager": eager, "compiled": compiled}

    for out in world(run_ranks, addrs, kind, fn):
        assert out["compiled"] == out["eager"], out
