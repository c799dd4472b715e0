"""Two FSDP ranks of a ``Linear(4, 2)`` as threads of the test, over real servers: what
``train_with_recovery`` does beside one rank that raises, checkpoints or leaves
(tests/test_checkpoint_retention.py, tests/test_stop_the_others.py,
tests/test_recovery_needs_server_state.py)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch

from paramshard.client import ClusterSpec, ShardClient
from paramshard.strategies import FSDPModel, FSDPOptimizer, ShardingConfiguration


def two_fsdp_ranks(
    addresses: list[str],
    job: str,
    body: Callable[[int, Any, Any], Any],
    elastic: bool = False,
    timeout_s: float = 30.0,
    token: str | None = None,
    **settings: Any,
) -> dict[int, Any]:
    """``body(rank, model, optimizer)`` on ranks 0 and 1 (SGD, lr 0.1), calling with bearer
    ``token``, ``settings`` the ShardingConfiguration's other settings; what each returned or
    raised. Fails when a rank still runs after 100 s."""
    run, out = uuid.uuid4().hex[:6], {}

    def rank(r: int) -> None:
        client = ShardClient(
            ClusterSpec(addresses, token=token),
            rank=r,
            world_size=2,
            run_id=run,
            timeout_s=timeout_s,
        )
        try:
            config = ShardingConfiguration(client, job=job, elastic=elastic, **settings)
            torch.manual_seed(0)
            model = FSDPModel(torch.nn.Linear(4, 2), config)
            opt = FSDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config)
            out[r] = body(r, model, opt)
        except BaseException as exc:  # noqa: BLE001 - the test reads what each rank raised
            out[r] = exc
        finally:
            client.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not any(t.is_alive() for t in threads), "a rank still runs"
    return out


def sgd_step(model: Any, opt: Any, x: torch.Tensor) -> float:
    """One step on batch ``x``; the loss."""
    loss = model(x).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()
