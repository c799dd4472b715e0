"""Trainers on a GPU: every strategy with ``model.to("cuda")`` equals the same run on the CPU.

The models, batches and gradients live on the GPU; what crosses to the servers is staged
through pinned host memory (strategies/device.py) and comes back to the parameters' device.
Each run is the float64 equivalence run of tests/test_strategies.py / tests/test_hybrid.py
with the model on CUDA, held to the same single-process reference and bound (the GPU's kernels
sum in other orders, which float64 absorbs: tests/numerics.py).

DDP and tensor parallelism run their ranks as processes here: thread ranks cannot share one
CUDA device when a rank waits for the others inside backward (torch's one autograd thread per
device; strategies/device.py), which the last test shows is refused at once, by name.

No GPU is lent to this project's CI: these tests are marked ``gpu`` and skipped without one,
and every line of strategies/device.py that is not CUDA-specific runs in the CPU suite.
"""

from __future__ import annotations

import time

import pytest
import torch
from numerics import assert_equivalent
from test_hybrid import reference, train_hybrid  # noqa: F401 - reference is a fixture
from test_strategies import STRATEGIES, batches, initial_state, train_sharded, train_single

from paramshard import RankFailed

pytestmark = pytest.mark.gpu  # skipped without a CUDA device for torch (tests/conftest.py)


def _on_cpu(state: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """The state's tensors, checked to be on ``device`` (the parameters' own), on the CPU."""
    for name, t in state.items():
        assert t.device.type == device, f"{name} came back on {t.device}, not {device}"
    return {name: t.cpu() for name, t in state.items()}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_data_parallel_strategies_on_cuda_equal_the_cpu_reference(strategy):
    init, data = initial_state(), batches()
    ref_losses, ref_state = train_single("adamw", init, data)
    processes = strategy == "ddp"  # its end of backward waits for the other rank
    for r, (losses, state) in enumerate(
        train_sharded(strategy, "adamw", 2, 2, init, data, device="cuda", processes=processes)
    ):
        assert_equivalent(losses, ref_losses, f"{strategy} cuda rank {r} losses")
        assert_equivalent(_on_cpu(state, "cuda"), ref_state, f"{strategy} cuda rank {r}")


@pytest.mark.parametrize("pp,tp,dp", [(2, 1, 1), (1, 2, 1), (2, 2, 1)])
def test_pipeline_tensor_and_3d_on_cuda_equal_the_cpu_reference(reference, pp, tp, dp):  # noqa: F811
    init, data, ref_losses, ref_state = reference
    processes = tp > 1  # tensor parallelism's backward all-reduces wait for the group
    results = train_hybrid(pp, tp, dp, init, data, device="cuda", processes=processes)
    for r, (losses, state, _, _) in enumerate(results):
        assert_equivalent(losses, ref_losses, f"({pp},{tp},{dp}) cuda rank {r} losses")
        assert_equivalent(_on_cpu(state, "cuda"), ref_state, f"({pp},{tp},{dp}) cuda rank {r}")


def test_thread_ranks_that_wait_inside_backward_on_one_cuda_device_are_refused(reference):  # noqa: F811
    """DDP and tensor parallelism as thread ranks on one GPU: refused at the second rank's first
    forward, naming what to do, instead of both waiting out their deadline."""
    init, data, _, _ = reference
    ddp_init, ddp_data = initial_state(), batches()
    runs = {
        "ddp": lambda: train_sharded("ddp", "adamw", 2, 2, ddp_init, ddp_data, device="cuda"),
        "tp": lambda: train_hybrid(1, 2, 1, init, data, device="cuda"),
    }
    for what, run in runs.items():
        began = time.monotonic()
        with pytest.raises(RankFailed) as failed:
            run()
        # the ranks' calls wait 60 s (timeout_s): a refusal by deadline comes after 59 s
        assert time.monotonic() - began < 40, what
        assert isinstance(failed.value.error, ValueError), (what, failed.value)
        message = str(failed.value.error)
        assert "one autograd thread per device" in message, (what, message)
        assert "LocalCluster(processes=True)" in message and "cuda:<rank>" in message
