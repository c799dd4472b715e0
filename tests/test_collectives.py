"""Collectives through the shard servers' reduction slots, against NumPy references.

Data are dyadic values small enough that every fp32 sum is exact whatever order the server
adds contributions in; the only rounding is the one the contract promises (float16 / bfloat16
sums accumulate in fp32 and are rounded once, at the end), so results compare exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramshard.client import ShardClient
from paramshard.protos.slicing import slice_bounds

# (world size, number of servers): one server per rank for 1..5, and fewer servers than ranks
WORLDS = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (3, 2)]
WORLD_IDS = [f"W{w}-N{n}" for w, n in WORLDS]
P2P_WORLDS = [w for w in WORLDS if w[0] > 1]  # sending to oneself: test_collectives_behaviour.py
P2P_IDS = [f"W{w}-N{n}" for w, n in P2P_WORLDS]
TIMEOUT_S = 10.0  # every call here completes in milliseconds; fail fast when one does not
LENGTHS = [0, 1, 2, 7, 1001, 4099]
DTYPES = ["float32", "float16", "int64", "bfloat16"]
SETTINGS = settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@dataclass(frozen=True)
class Case:
    dtype: str
    n: int
    seed: int
    torch_in: bool  # pass torch tensors (always for bfloat16)
    matrix: bool  # a 2-D shape instead of 1-D

    def shape(self, n: int | None = None) -> tuple[int, ...]:
        n = self.n if n is None else n
        return (7, n // 7) if self.matrix and n and n % 7 == 0 else (n,)

    def values(self, rank: int, n: int | None = None, salt: int = 0) -> np.ndarray:
        """Exact values of rank ``rank``'s tensor (float32 for bfloat16), in its shape."""
        n = self.n if n is None else n
        rng = np.random.default_rng([self.seed, rank, n, salt])
        if self.dtype == "int64":
            v = rng.integers(-(2**40), 2**40, n, dtype=np.int64)
        elif self.dtype == "float16":
            v = (rng.integers(-2047, 2048, n) * 2.0**-4).astype(np.float16)
        elif self.dtype == "bfloat16":
            v = (rng.integers(-255, 256, n) * 2.0**-3).astype(np.float32)
        else:
            v = (rng.integers(-2000, 2001, n) * 0.25).astype(np.float32)
        return v.reshape(self.shape(n))

    def tensor(self, rank: int, n: int | None = None, salt: int = 0) -> Any:
        v = self.values(rank, n, salt)
        if self.dtype == "bfloat16":
            return torch.from_numpy(v).to(torch.bfloat16)
        return torch.from_numpy(v.copy()) if self.torch_in else v


cases = st.builds(
    Case,
    dtype=st.sampled_from(DTYPES),
    n=st.sampled_from(LENGTHS),
    seed=st.integers(0, 2**16),
    torch_in=st.booleans(),
    matrix=st.booleans(),
)


def to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    return np.asarray(x)


def check_type(out: Any, case: Case, shape: tuple[int, ...]) -> None:
    """Torch in -> torch out of the same dtype; NumPy in -> NumPy out of the same dtype."""
    assert tuple(out.shape) == shape
    if case.dtype == "bfloat16":
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    elif case.torch_in:
        assert isinstance(out, torch.Tensor) and out.dtype == getattr(torch, case.dtype)
    else:
        assert isinstance(out, np.ndarray) and out.dtype == np.dtype(case.dtype)


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 results rounded once to the wire dtype (as exact values, float32 or int64)."""
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16).float().numpy()
    return values


def reference(case: Case, world: int, op: str) -> np.ndarray:
    """What the servers compute: fp32 (int64 for integers) accumulation, rounded once."""
    stack = np.stack([case.values(r) for r in range(world)])
    acc = stack if case.dtype == "int64" else stack.astype(np.float32)
    if op in ("sum", "mean"):
        out = acc.sum(axis=0, dtype=acc.dtype)
        if op == "mean":
            out = out / acc.dtype.type(world)
    else:
        out = acc.max(axis=0) if op == "max" else acc.min(axis=0)
    return round_to(out, case.dtype)


def ops_for(case: Case) -> list[str]:
    return ["sum", "max", "min"] + ([] if case.dtype == "int64" else ["mean"])


def world_addresses(shared: list[str], num_servers: int) -> list[str]:
    return shared[:num_servers]


# --- the collectives, every world size ------------------------------------------------------


@pytest.mark.parametrize(("world", "num_servers"), WORLDS, ids=WORLD_IDS)
@SETTINGS
@given(case=cases)
def test_all_reduce(transport_servers, run_ranks, world: int, num_servers: int, case: Case) -> None:
    ops = ops_for(case)
    results = run_ranks(
        lambda c: [c.all_reduce(case.tensor(c.rank), op=op) for op in ops],
        world,
        world_addresses(transport_servers, num_servers),
        timeout_s=TIMEOUT_S,
    )
    for op_index, op in enumerate(ops):
        want = reference(case, world, op)
        for rank, outs in enumerate(results):
            out = outs[op_index]
            check_type(out, case, case.shape())
            np.testing.assert_array_equal(to_numpy(out), want, err_msg=f"{op} rank {rank}")


@pytest.mark.parametrize(("world", "num_servers"), WORLDS, ids=WORLD_IDS)
@SETTINGS
@given(case=cases)
def test_reduce_scatter(
    transport_servers, run_ranks, world: int, num_servers: int, case: Case
) -> None:
    ops = ops_for(case)
    results = run_ranks(
        lambda c: [c.reduce_scatter(case.tensor(c.rank), op=op) for op in ops],
        world,
        world_addresses(transport_servers, num_servers),
        timeout_s=TIMEOUT_S,
    )
    for op_index, op in enumerate(ops):
        full = reference(case, world, op).reshape(-1)
        for rank, outs in enumerate(results):
            a, b = slice_bounds(case.n, world, rank)
            check_type(outs[op_index], case, (b - a,))
            np.testing.assert_array_equal(
                to_numpy(outs[op_index]), full[a:b], err_msg=f"{op} rank {rank}"
            )


@pytest.mark.parametrize(("world", "num_servers"), WORLDS, ids=WORLD_IDS)
@SETTINGS
@given(case=cases)
def test_all_gather(transport_servers, run_ranks, world: int, num_servers: int, case: Case) -> None:
    # every rank's tensor has its own length (n + rank) and so its own shape
    results = run_ranks(
        lambda c: c.all_gather(case.tensor(c.rank, case.n + c.rank)),
        world,
        world_addresses(transport_servers, num_servers),
        timeout_s=TIMEOUT_S,
    )
    for rank, gathered in enumerate(results):
        assert len(gathered) == world
        for j, got in enumerate(gathered):
            want = case.values(j, case.n + j)
            check_type(got, case, want.shape)
            np.testing.assert_array_equal(
                to_numpy(got),
                want.astype(to_numpy(got).dtype),
                err_msg=f"rank {rank} got rank {j}'s tensor wrong",
            )


@pytest.mark.parametrize(("world", "num_servers"), WORLDS, ids=WORLD_IDS)
@SETTINGS
@given(case=cases)
def test_broadcast(transport_servers, run_ranks, world: int, num_servers: int, case: Case) -> None:
    # broadcast from every rank in turn; each rank passes its own values
    results = run_ranks(
        lambda c: [c.broadcast(case.tensor(c.rank), src=s) for s in range(world)],
        world,
        world_addresses(transport_servers, num_servers),
        timeout_s=TIMEOUT_S,
    )
    for rank, outs in enumerate(results):
        for src, out in enumerate(outs):
            check_type(out, case, case.shape())
            np.testing.assert_array_equal(
                to_numpy(out), case.values(src), err_msg=f"rank {rank}, src {src}"
            )


@pytest.mark.parametrize(("world", "num_servers"), P2P_WORLDS, ids=P2P_IDS)
@SETTINGS
@given(spec=st.tuples(cases, st.integers(1, 3)))
def test_send_recv_in_order(
    transport_servers, run_ranks, world: int, num_servers: int, spec: tuple[Case, int]
) -> None:
    """Each rank sends ``count`` tensors (of different lengths) to the next rank, in a ring."""
    case, count = spec

    def ring(c: ShardClient) -> list[Any]:
        dst, src = (c.rank + 1) % world, (c.rank - 1) % world
        for k in range(count):
            c.send(case.tensor(c.rank, case.n + k, salt=k), dst)
        like = case.tensor(c.rank) if case.torch_in else None
        return [c.recv(src, like=like) for _ in range(count)]

    results = run_ranks(
        ring, world, world_addresses(transport_servers, num_servers), timeout_s=TIMEOUT_S
    )
    for rank, received in enumerate(results):
        src = (rank - 1) % world
        for k, got in enumerate(received):
            want = case.values(src, case.n + k, salt=k)
            if case.torch_in or case.dtype == "bfloat16":
                check_type(got, case, want.shape)
            else:  # NumPy in, no ``like``: a NumPy array of the sender's dtype
                assert isinstance(got, np.ndarray) and got.dtype == np.dtype(case.dtype)
                assert got.shape == want.shape
            np.testing.assert_array_equal(
                to_numpy(got), want.astype(to_numpy(got).dtype), err_msg=f"rank {rank}, message {k}"
            )
