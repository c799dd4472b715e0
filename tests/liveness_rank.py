"""One rank of tests/test_liveness.py's jobs, as its own process (the environment of
``paramshard launch``: RANK, WORLD_SIZE, PARAMSHARD_SERVERS, PARAMSHARD_RUN).

    python tests/liveness_rank.py STEPS PAUSE_S [HOLD_GIL_AT HOLD_GIL_S]

ZeRO-1 training of a small float64 MLP, the same data for the same step: it prints ``step N``
before each step and sleeps ``PAUSE_S`` after it (so a test can stop or kill it mid-run), holds
Python's GIL for ``HOLD_GIL_S`` seconds before step ``HOLD_GIL_AT`` (no other thread of the
process runs meanwhile), and ends with ``PARAMS [...]`` (the final parameters). A failure is
printed as ``FAILED <CLOCK_MONOTONIC> <error>`` and exits 1: the clock is the machine's, so the
test can tell how long after a kill this rank learned of it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from paramshard.strategies import DATA_PARALLEL, ShardingConfiguration


def hold_gil(seconds: float) -> None:
    """Pure Python with a switch interval longer than ``seconds``: no other thread of this
    process (the lease's renewals included) gets the GIL until it ends."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 30.0)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(before)


def main() -> int:
    steps, pause = int(sys.argv[1]), float(sys.argv[2])
    gil_at, gil_s = (int(sys.argv[3]), float(sys.argv[4])) if len(sys.argv) > 4 else (-1, 0.0)
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    ).double()
    config = ShardingConfiguration.from_env(job=os.environ["PARAMSHARD_RUN"], timeout_s=120.0)
    model_cls, opt_cls = DATA_PARALLEL["zero1"]
    try:
        model = model_cls(net, config)
        opt = opt_cls(torch.optim.SGD(net.parameters(), lr=0.1), config)
        for step in range(steps):
            if step == gil_at:
                hold_gil(gil_s)
            print(f"step {step}", flush=True)
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(4, 8, generator=g, dtype=torch.float64)
            y = torch.randn(4, 1, generator=g, dtype=torch.float64)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(pause)
        print("PARAMS " + json.dumps([p.detach().flatten().tolist() for p in net.parameters()]))
        return 0
    except Exception as exc:  # noqa: BLE001 - what the test checks
        print(f"FAILED {time.monotonic()} {exc}", flush=True)
        return 1
    finally:
        config.client.close()


if __name__ == "__main__":
    sys.exit(main())
