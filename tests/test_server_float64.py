"""The servers' half of issue 11: float64 masters, and sums in rank order whatever the arrival.

- A buffer registered with ``master_dtype=FLOAT64`` keeps params, gradient accumulator and
  optimizer state in float64, and its optimizers equal torch.optim on float64 tensors.
- Gradient contributions (buffers) and reduction-slot contributions (collectives) are added in
  (contributor, micro-batch) order: every arrival order gives the same bits. The same tests
  with ``arrival_order`` show that the order would otherwise change the result, so they can
  fail.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from numerics import assert_equivalent
from test_optimizers import CASES, case_id, torch_optimizer

from paramshard.protos import shard_pb2 as pb
from paramshard.server.buffers.store import BufferStore
from paramshard.server.collectives.slots import SlotStore
from paramshard.server.optimizers import make_optimizer
from paramshard.server.runtime import backend
from paramshard.server.runtime.errors import ShardError

NUMEL = 257


@pytest.fixture(autouse=True)
def numpy_backend() -> None:
    backend.use_device("cpu")


@pytest.mark.equivalence
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_float64_optimizers_match_torch_float64(case: tuple[str, dict[str, float]]) -> None:
    name, hyper = case
    rng = np.random.default_rng(CASES.index(case))
    p0 = rng.standard_normal(NUMEL)
    grads = rng.standard_normal((100, NUMEL))
    param = torch.tensor(p0, requires_grad=True)
    ref = torch_optimizer(name, param, hyper)
    ours = make_optimizer(name, NUMEL, hyper, "float64")
    mine = p0.copy()
    for g in grads:
        param.grad = torch.from_numpy(g.copy())
        ref.step()
        ours.step(mine, g.copy())
    # float64 round-off over 100 steps cannot come near the bound: any miss is a formula bug
    assert mine.dtype == np.float64
    assert_equivalent(mine, param.detach().numpy(), f"{name} params")
    for key, arr in ours.state_arrays().items():
        assert arr.dtype == np.float64, key
        assert_equivalent(arr, ref.state[param][key].numpy(), f"{name} {key}")


def test_float32_shards_refuse_float64_arrays_and_back() -> None:
    opt = make_optimizer("sgd", 4, {}, "float64")
    with pytest.raises(ValueError, match="float64 with 4 elements"):
        opt.step(np.zeros(4, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="float32 or float64"):
        make_optimizer("sgd", 4, {}, "float16")


# -- buffers -------------------------------------------------------------------------------


def register(
    store: BufferStore, contributors: int, *, master: int, arrival_order: bool = False
) -> object:
    req = pb.RegisterBufferRequest(
        ref=pb.BufferRef(job="j", buffer="b"),
        numel=NUMEL,
        num_servers=1,
        server_index=0,
        contributors=contributors,
        optimizer=pb.OptimizerSpec(name="sgd", hyper={"lr": 1.0}),
        master_dtype=master,
        arrival_order=arrival_order,
    )
    b = store.register(req)
    zeros = np.zeros(NUMEL, np.float64 if master == pb.FLOAT64 else np.float32)
    wire = pb.FLOAT64 if master == pb.FLOAT64 else pb.FLOAT32
    header = pb.SetParamsHeader(
        ref=req.ref, chunk=pb.Chunk(offset=0, numel=NUMEL, dtype=wire), version=0
    )
    b.set_params(header, memoryview(zeros.tobytes()))
    return b


def contributions(contributors: int, micro: int, dtype: type) -> dict[tuple[int, int], np.ndarray]:
    """Values whose sums depend on the order: wide exponent range, random signs."""
    rng = np.random.default_rng(11)
    return {
        (c, m): (rng.standard_normal(NUMEL) * 10.0 ** rng.integers(-6, 7, NUMEL)).astype(dtype)
        for c in range(contributors)
        for m in range(micro)
    }


def reduce_in(
    order: Sequence[tuple[int, int]],
    values: dict,
    contributors: int,
    micro: int,
    *,
    master: int,
    arrival_order: bool = False,
    chunks: int = 3,
) -> np.ndarray:
    """The reduced gradient a buffer computes when the chunks arrive in ``order``: each
    contribution cut into ``chunks`` pieces sent last piece first."""
    b = register(BufferStore(), contributors, master=master, arrival_order=arrival_order)
    wire = pb.FLOAT64 if master == pb.FLOAT64 else pb.FLOAT32
    cuts = np.linspace(0, NUMEL, chunks + 1).astype(int)
    for c, m in order:
        for lo, hi in reversed(list(itertools.pairwise(cuts))):
            header = pb.PushGradHeader(
                ref=pb.BufferRef(job="j", buffer="b"),
                chunk=pb.Chunk(offset=int(lo), numel=int(hi - lo), dtype=wire),
                step=0,
                contributor=c,
                micro=m,
                num_micro=micro,
            )
            b.push_grad(header, memoryview(values[c, m][lo:hi].tobytes()), timeout=1.0)
    assert b.pending.reduced and not b.pending.staged and b.pending.staged_bytes == 0
    return b.grad.copy()


@pytest.mark.parametrize("master", [pb.FLOAT32, pb.FLOAT64], ids=["float32", "float64"])
def test_gradients_are_reduced_in_rank_order_whatever_the_arrival(master: int) -> None:
    contributors, micro = 3, 2
    dtype = np.float64 if master == pb.FLOAT64 else np.float32
    values = contributions(contributors, micro, dtype)
    in_order = sorted(values)
    want = np.zeros(NUMEL, dtype)
    for key in in_order:
        want += values[key]
    want /= dtype(contributors)
    orders = list(itertools.permutations(in_order))[::37]  # 20 of the 720 orders
    for order in orders:
        got = reduce_in(order, values, contributors, micro, master=master)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want, err_msg=f"arrival order {order}")
    # Arrival-order sums really do depend on the order here, so the check above can fail.
    sums = {
        reduce_in(o, values, contributors, micro, master=master, arrival_order=True).tobytes()
        for o in orders
    }
    assert len(sums) > 1


def test_staged_contributions_count_as_gradient_bytes() -> None:
    store = BufferStore()
    b = register(store, 3, master=pb.FLOAT64)
    x = np.ones(NUMEL)
    header = pb.PushGradHeader(
        ref=pb.BufferRef(job="j", buffer="b"),
        chunk=pb.Chunk(offset=0, numel=NUMEL, dtype=pb.FLOAT64),
        step=0,
        contributor=2,
        num_micro=1,
    )
    b.push_grad(header, memoryview(x.tobytes()), timeout=1.0)  # early: contributor 2 waits
    params, grads, _ = b.bytes_by_kind()
    assert params == NUMEL * 8 and grads == 2 * NUMEL * 8  # accumulator + staged copy
    (row,) = store.status()[0].buffers
    assert row.dtype == "float64" and row.grad_bytes == grads


def test_master_dtype_is_float32_or_float64_and_part_of_the_layout() -> None:
    store = BufferStore()
    register(store, 1, master=pb.FLOAT32)
    bad = pb.RegisterBufferRequest(
        ref=pb.BufferRef(job="k", buffer="b"),
        numel=4,
        num_servers=1,
        contributors=1,
        optimizer=pb.OptimizerSpec(name="sgd"),
        master_dtype=pb.BFLOAT16,
    )
    with pytest.raises(ShardError, match="master_dtype must be FLOAT32 or FLOAT64") as err:
        store.register(bad)
    assert err.value.code.name == "INVALID_ARGUMENT"
    again = pb.RegisterBufferRequest(
        ref=pb.BufferRef(job="j", buffer="b"),
        numel=NUMEL,
        num_servers=1,
        contributors=1,
        optimizer=pb.OptimizerSpec(name="sgd", hyper={"lr": 1.0}),
        master_dtype=pb.FLOAT64,
    )
    with pytest.raises(ShardError, match="master dtype float32 here, float64 asked") as err:
        store.register(again)
    assert err.value.code.name == "FAILED_PRECONDITION"


# -- reduction slots ------------------------------------------------------------------------


def slot_sum(order: Sequence[int], values: list[np.ndarray], wire: int, **kw: object) -> bytes:
    store = SlotStore()
    n = values[0].size
    for c in order:
        header = pb.SlotHeader(
            key="k",
            op=pb.MEAN,
            expected=len(values),
            readers=1,
            total_numel=n,
            chunk_numel=n,
            chunk=pb.Chunk(offset=0, numel=n, dtype=wire),
            contributor=c,
            **kw,
        )
        assert store.contribute(header, memoryview(values[c].tobytes())) is False
    _, payload = store.read(pb.ReadSlotRequest(key="k", offset=0, reader=0), timeout=1.0)
    assert store.usage() == (0, 0)  # read by its one reader: freed, staging included
    return bytes(payload)


@pytest.mark.parametrize(
    ("wire", "dtype"), [(pb.FLOAT32, np.float32), (pb.FLOAT64, np.float64)], ids=["f32", "f64"]
)
def test_slots_add_contributors_in_rank_order(wire: int, dtype: type) -> None:
    values = [v for (_, m), v in sorted(contributions(4, 1, dtype).items()) if m == 0]
    want = values[0].copy()
    for v in values[1:]:
        want += v
    want /= dtype(4)
    orders = list(itertools.permutations(range(4)))
    for order in orders:
        got = np.frombuffer(slot_sum(order, values, wire), dtype)
        np.testing.assert_array_equal(got, want, err_msg=f"arrival order {order}")
    sums = {slot_sum(o, values, wire, arrival_order=True) for o in orders}
    assert len(sums) > 1  # without rank order the arrival shows in the bits
