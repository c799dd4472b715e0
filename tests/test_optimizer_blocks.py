"""server.optimizers run their update in blocks (``base.BLOCK`` elements at a time, so each
temporary is one block, not one slice): the result is bitwise the one of a single pass over the
whole slice, for every optimizer and the flags that change its state (SGD's momentum buffer is
seeded in its first step, block by block), and the step's temporaries no longer grow with the
slice."""

from __future__ import annotations

import numpy as np
import pytest
from test_optimizers import CASES

from paramshard.server.optimizers import base, make_optimizer

NUMEL = 2 * base.BLOCK + 1001  # three blocks, the last one partial
SCRATCH = 64 * base.BLOCK  # a few blocks of temporaries, in bytes


def run(name: str, hyper: dict[str, float], steps: int = 3) -> tuple[np.ndarray, dict]:
    rng = np.random.default_rng(7)
    opt = make_optimizer(name, NUMEL, hyper)
    param = rng.standard_normal(NUMEL).astype(np.float32)
    for _ in range(steps):
        opt.step(param, rng.standard_normal(NUMEL).astype(np.float32))
    return param, {k: v.copy() for k, v in opt.state_arrays().items()}


@pytest.mark.parametrize(("name", "hyper"), CASES, ids=[f"{n}-{h}" for n, h in CASES])
def test_blocks_equal_one_pass(name: str, hyper: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked, blocked_state = run(name, hyper)
    monkeypatch.setattr(base, "BLOCK", NUMEL)  # one block: the whole slice in one pass
    whole, whole_state = run(name, hyper)
    np.testing.assert_array_equal(blocked, whole)
    assert blocked_state.keys() == whole_state.keys()
    for key, value in whole_state.items():
        np.testing.assert_array_equal(blocked_state[key], value, err_msg=key)


def test_step_temporaries_are_one_block() -> None:
    """A step on 8M elements raises the process's peak resident memory by no more than a few
    blocks (one pass over the slice made 8 bytes an element of temporaries: 64 MB here)."""
    n = 8 * 2**20
    opt = make_optimizer("adamw", n, {"lr": 1e-3, "amsgrad": 1.0})
    param = np.ones(n, np.float32)
    grad = np.full(n, 0.5, np.float32)
    opt.step(param, grad.copy())  # allocates the state

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key + ":"))

    try:  # 5: reset the peak resident size to the current one (Linux's clear_refs)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        pytest.skip(f"cannot reset the peak resident size here: {exc}")
    before = status("VmRSS")
    for _ in range(2):
        opt.step(param, grad.copy())  # the copy itself is 4 bytes an element
    grew = status("VmHWM") - before
    assert grew <= 4 * n + SCRATCH, f"{grew / n:.2f} bytes an element"
