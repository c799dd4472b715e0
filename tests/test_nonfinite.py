"""Non-finite gradients never reach the model: a step is applied on every server or on none.

Issue 13, finding 9: a NaN PushGrad used to be accepted and left every parameter NaN after the
step. Now each server reports its reduced slice's finiteness (GradNorm), the client sends all
of them the same Step, applied or skipped (server/buffers/nonfinite.py), and the trainer raises
``NonFiniteGradientError`` naming job, buffer and server, or with
``ShardingConfiguration(skip_nonfinite=True)`` counts the step and trains on. Real gRPC
servers (``local_calls=False``); the bad gradient sits in one rank's contribution to one
server's slice only, so the other server must skip a step its own slice would allow.
"""

from __future__ import annotations

import itertools
import threading
import uuid

import numpy as np
import pytest
import torch
from conftest import run_ranks, unique_id

from paramshard.client import (
    ClusterSpec,
    GradCheck,
    NonFiniteGradientError,
    ShardClient,
    ShardClientError,
    StepArgs,
)
from paramshard.strategies import (
    DATA_PARALLEL,
    HybridShardedModel,
    HybridShardedOptimizer,
    ShardingConfiguration,
)
from paramshard.strategies.nonfinite import nonfinite_grads

STRATEGIES = DATA_PARALLEL
WORLD, STEPS, BAD_STEP, BAD_RANK = 2, 4, 1, 1


# -- helpers --------------------------------------------------------------------------------
def server_state(nodes: list) -> dict[tuple[int, str, str], np.ndarray]:
    """(server, buffer, what) -> a copy of what each server holds of every job: "params",
    each optimizer state array, its step count, the version and the skipped steps."""
    out = {}
    for i, node in enumerate(nodes):
        for job, slices in node.servicer.buffers.jobs().items():
            for b in slices:
                with b.cond:
                    captured = b.copy_state()
                    out[i, f"{job}/{b.name}", "version"] = np.array(b.version)
                    out[i, f"{job}/{b.name}", "skipped"] = np.array(b.skipped_steps)
                out[i, f"{job}/{b.name}", "params"] = captured.params
                out[i, f"{job}/{b.name}", "optimizer_steps"] = np.array(captured.step_count)
                for key, value in captured.state.items():
                    out[i, f"{job}/{b.name}", key] = value
    return out


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        a, b = np.asarray(got[key]), np.asarray(value)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{what}: {key} changed"


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    xs = torch.randn(STEPS, WORLD, 5, 6, generator=g)
    return xs, torch.randn(STEPS, WORLD, 5, 3, generator=g)


def net(extra: int = 0) -> torch.nn.Module:
    """Two linear layers (and ``extra`` more), the same values wherever it is built (ranks
    are threads sharing torch's global generator, so it is not used)."""
    sizes = [6, 16, 3] + [3] * extra
    layers: list[torch.nn.Module] = []
    g = torch.Generator().manual_seed(4)
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layer = torch.nn.Linear(a, b)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(b, a, generator=g) / a**0.5)
            layer.bias.copy_(torch.randn(b, generator=g) * 0.1)
        layers += [layer, torch.nn.Tanh()] if i == 0 else [layer]
    return torch.nn.Sequential(*layers)


def poison_last_element(p: torch.nn.Parameter, bad: float, when: threading.Event) -> None:
    """While ``when`` is set, the last element of ``p``'s gradient becomes ``bad``: the end
    of the last buffer, so on the last server's slice only."""

    def hook(g: torch.Tensor) -> torch.Tensor:
        if not when.is_set():
            return g
        g = g.clone()
        g.view(-1)[-1] = bad
        return g

    p.register_hook(hook)


def train(
    strategy: str,
    addresses: list[str],
    job: str,
    steps: list[int],
    *,
    skip: bool,
    bad: float = float("nan"),
    on_step=None,
) -> list[dict]:
    """Trains ``net()`` on the given steps' batches, rank r on its part of each; at BAD_STEP
    rank BAD_RANK's gradient gets ``bad`` in one element. Per rank: final parameters,
    optimizer state, the errors raised, skipped_steps and step_count."""
    model_cls, opt_cls = STRATEGIES[strategy]
    xs, ys = data()

    def rank(client: ShardClient) -> dict:
        config = ShardingConfiguration(client, job=job, skip_nonfinite=skip)
        inner = net()
        kw = {"wrap": (torch.nn.Linear,)} if strategy == "fsdp" else {}
        model = model_cls(inner, config, **kw)
        opt = opt_cls(torch.optim.Adam(inner.parameters(), lr=0.05), config)
        poisoned = threading.Event()
        poison_last_element(list(inner.parameters())[-1], bad, poisoned)
        errors = []
        for s in steps:
            if client.rank == BAD_RANK and s == BAD_STEP:
                poisoned.set()
            if on_step is not None:
                on_step(client.rank, s, model, opt)
            x, y = xs[s, client.rank], ys[s, client.rank]
            torch.nn.functional.mse_loss(model(x), y).backward()
            poisoned.clear()
            try:
                opt.step()
            except NonFiniteGradientError as exc:
                errors.append(exc)
            opt.zero_grad()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return {
            "params": state,
            "optim": opt.state_dict()["state"],
            "errors": errors,
            "skipped": model.skipped_steps,
            "step_count": getattr(model, "step_count", None),
        }

    return run_ranks(rank, WORLD, addresses, run_id=unique_id(), timeout_s=30.0)


def flat_optim(state: dict) -> dict:
    return {(i, k): v for i, st in state.items() for k, v in st.items()}


# -- the flat-buffer API: the finding as reported -------------------------------------------
def test_nan_push_is_never_applied(servers):
    """The finding's reproduction: rank 1 pushes NaN in a W=2 job on 2 servers (server 1's
    slice only). ``step_if_finite`` finds it (naming buffer and server) and skips the step on
    both servers: params and optimizer state stay bitwise as they were (before: every
    parameter NaN after the step)."""
    nodes = servers(2, local_calls=False)
    addresses = [n.address for n in nodes]
    job, numel = unique_id("nan"), 10  # server 0: [0, 5), server 1: [5, 10)
    init = np.linspace(-1, 1, numel, dtype=np.float32)

    def rank(c: ShardClient) -> GradCheck:
        c.register_buffer(job, "w", numel, optimizer="adam", hyper={"lr": 0.1})
        if c.rank == 0:
            c.set_params(job, "w", init)
        c.push_grads(job, "w", np.full(numel, 0.5 + c.rank, np.float32), 0)
        assert c.step_if_finite(job, 0, {"w": StepArgs({"lr": 0.1})}).finite
        c.barrier()
        if c.rank == 0:
            state.update(before=server_state(nodes))
        c.barrier()
        g = np.ones(numel, np.float32)
        if c.rank == 1:
            g[7] = np.nan  # server 1's slice only
        c.push_grads(job, "w", g, 1)
        return c.step_if_finite(job, 1, {"w": StepArgs({"lr": 0.1})})

    state: dict = {}
    for check in run_ranks(rank, WORLD, addresses):
        assert not check.finite and (check.job, check.step) == (job, 1)
        assert check.nonfinite == (f"buffer 'w' on server 1 ({addresses[1]})",)
    after = server_state(nodes)
    for i in range(2):  # the step was taken (skipped): version 2, one skip, nothing else moved
        assert after.pop((i, f"{job}/w", "version")) == 2
        assert after.pop((i, f"{job}/w", "skipped")) == 1
        assert state["before"].pop((i, f"{job}/w", "version")) == 1
        assert state["before"].pop((i, f"{job}/w", "skipped")) == 0
    assert_bitwise(after, state["before"], "after the NaN step")
    assert all(np.isfinite(v).all() for v in after.values())
    status = ShardClient(ClusterSpec(addresses)).status()
    assert [r["jobs"][0]["buffers"][0]["skipped_steps"] for r in status] == ["1", "1"]


def test_a_step_told_to_apply_nonfinite_is_refused(servers):
    """A client that skips the first phase cannot poison a slice: Step without ``skip``
    refuses (FAILED_PRECONDITION) and changes nothing; a push with step_args does not step
    it either; Step with ``skip`` then moves every buffer on, unchanged."""
    nodes = servers(1, local_calls=False)
    c = ShardClient(ClusterSpec([nodes[0].address]))
    job = unique_id("refuse")
    for name in ("a", "b"):
        c.register_buffer(job, name, 4, optimizer="sgd", hyper={"lr": 0.1, "momentum": 0.9})
        c.set_params(job, name, np.arange(4, dtype=np.float32))
    args = {"a": StepArgs({"lr": 0.1}), "b": StepArgs({"lr": 0.1})}
    c.push_grads(job, "a", np.ones(4, np.float32), 0)
    c.push_grads(job, "b", np.array([1, np.inf, 1, 1], np.float32), 0, step_args=args["b"])
    before = server_state(nodes)
    with pytest.raises(ShardClientError, match=r"FAILED_PRECONDITION.*buffer '.*/b'.*NaN or Inf"):
        c.step(job, 0, args, skip=False)
    assert_bitwise(server_state(nodes), before, "after the refused step")  # 'a' did not step
    assert c.grad_check(job, ["a", "b"], 0).nonfinite == (
        f"buffer 'b' on server 0 ({nodes[0].address})",
    )
    c.step(job, 0, args, skip=True)
    after = server_state(nodes)
    for name in ("a", "b"):
        assert after.pop((0, f"{job}/{name}", "version")) == 1
        assert after.pop((0, f"{job}/{name}", "skipped")) == 1
        before.pop((0, f"{job}/{name}", "version"))
        before.pop((0, f"{job}/{name}", "skipped"))
    assert_bitwise(after, before, "after the skipped step")
    c.step(job, 0, args, skip=False)  # a repeat of a step taken is acknowledged, as before


# -- the strategies ---------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_error_names_job_and_buffer_and_nothing_steps(servers, strategy):
    """Without skip_nonfinite every rank raises, naming the job and where the gradient is not
    finite, and no server (DDP: no rank) applied the step: parameters and optimizer state
    bitwise as after the step before."""
    nodes = servers(2, local_calls=False)
    job = unique_id(f"err-{strategy}-")
    before: dict = {}

    def capture(rank: int, step: int, model, opt) -> None:
        if step == BAD_STEP:  # the servers cannot step before this rank pushes
            before[rank] = (server_state(nodes), model.state_dict(), opt.state_dict()["state"])

    results = train(strategy, [n.address for n in nodes], job, [0, BAD_STEP], skip=False,
                    on_step=capture)  # fmt: skip
    for r, res in enumerate(results):
        (err,) = res["errors"]
        assert err.job == job and err.step == (None if strategy == "ddp" else BAD_STEP)
        message = str(err)
        assert f"job '{job}'" in message and "skip_nonfinite=True" in message
        if strategy == "ddp":
            assert "parameter '2.bias'" in message  # the same averages on every rank
        else:
            assert "buffer '" in message and "on server 1" in message
            assert "on server 0" not in message  # server 0's slices were finite: it skipped too
        assert res["skipped"] == 1
        servers_then, params_then, optim_then = before[r]
        assert_bitwise(res["params"], params_then, f"rank {r} parameters")
        assert_bitwise(flat_optim(res["optim"]), flat_optim(optim_then), f"rank {r} optimizer")
    if strategy != "ddp":
        now = server_state(nodes)
        for key in [k for k in now if k[2] in ("version", "skipped")]:
            assert now.pop(key) == servers_then.pop(key) + 1
        assert_bitwise(now, servers_then, "servers")


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_skip_nonfinite_trains_on_as_if_the_batch_was_never_seen(servers, strategy):
    """With skip_nonfinite=True the bad step is skipped everywhere and counted (on every
    rank, and per buffer in every server's Status), and training goes on: the final
    parameters and optimizer state equal, bitwise, a run that never saw that batch."""
    nodes = servers(2, local_calls=False)
    addresses = [n.address for n in nodes]
    job = unique_id(f"skip-{strategy}-")
    got = train(strategy, addresses, job, list(range(STEPS)), skip=True, bad=float("inf"))
    want = train(strategy, addresses, unique_id("ref-"), [s for s in range(STEPS) if s != BAD_STEP],
                 skip=False)  # fmt: skip
    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["skipped"] == 1 and not g["errors"] and w["skipped"] == 0
        assert_bitwise(g["params"], w["params"], f"rank {r} parameters")
        assert_bitwise(flat_optim(g["optim"]), flat_optim(w["optim"]), f"rank {r} optimizer")
        if strategy != "ddp":
            assert g["step_count"] == STEPS  # a skipped step is a step taken (the version)
    if strategy != "ddp":
        rows = ShardClient(ClusterSpec(addresses)).status()
        counts = {
            (r["index"], b["buffer"]): int(b.get("skipped_steps", 0))
            for r in rows
            for j in r["jobs"]
            if j["job"] == job
            for b in j["buffers"]
        }
        assert counts and set(counts.values()) == {1}, counts


# -- 3D: every part skips, or none ------------------------------------------------------------
@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_hybrid_parts_agree(servers, max_norm):
    """Two pipeline stages (two part jobs): the NaN is in the last stage's gradient only, and
    the first stage, whose own gradient is finite, skips as well; its error names the part
    that was not finite. With skip_nonfinite the run equals one that skipped that batch. With
    clipping the parts agree on the all-reduce of the norm, else on one of their own."""
    nodes = servers(2, local_calls=False)
    addresses = [n.address for n in nodes]
    xs, ys = data()

    def run(job: str, steps: list[int], skip: bool) -> list[dict]:
        def rank(client: ShardClient) -> dict:
            config = ShardingConfiguration(client, job=job, skip_nonfinite=skip)
            inner = net(extra=1)
            model = HybridShardedModel(inner, config, 2, 1, 1, micro_batch_count=1)
            HybridShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), config)
            poisoned = threading.Event()
            if model.coords[0] == 1:
                poison_last_element(list(model.stage.parameters())[-1], np.nan, poisoned)
            errors = []
            for s in steps:
                if s == BAD_STEP:
                    poisoned.set()
                try:
                    model.train_on_batch(
                        xs[s].reshape(-1, 6), ys[s].reshape(-1, 3), max_grad_norm=max_norm
                    )
                except NonFiniteGradientError as exc:
                    errors.append(str(exc))
                poisoned.clear()
            return {"params": model.state_dict(), "errors": errors, "skipped": model.skipped_steps}

        return run_ranks(rank, WORLD, addresses, run_id=unique_id(), timeout_s=30.0)

    job = f"hyb-{uuid.uuid4().hex[:6]}"
    failed = run(job, [0, BAD_STEP], skip=False)
    assert [len(r["errors"]) for r in failed] == [1, 1]
    assert f"part job '{job}.pp1.tp0' (ranks 1)" in failed[0]["errors"][0]
    assert "on server" in failed[1]["errors"][0]
    got = run(f"{job}-skip", list(range(STEPS)), skip=True)
    want = run(f"{job}-ref", [s for s in range(STEPS) if s != BAD_STEP], skip=False)
    for r in range(WORLD):
        assert got[r]["skipped"] == 1 and not got[r]["errors"]
        assert_bitwise(got[r]["params"], want[r]["params"], f"rank {r}")


# -- the trainer's own check (DDP) ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_nonfinite_grads_finds_every_nan_and_inf_wherever_it_is(dtype):
    """``nonfinite_grads`` reads a dense gradient once through its least and greatest value:
    a NaN or an infinity of either sign is found at its first, last and a middle element
    (inside the vectorized loop and in its tail), and the largest finite values are finite."""
    n = 1027  # not a multiple of any vector width: a tail after the vectorized part
    big = torch.finfo(dtype).max
    named = [("empty", torch.nn.Parameter(torch.zeros(0, dtype=dtype)))]
    named[0][1].grad = torch.zeros(0, dtype=dtype)  # nothing to check: never named
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in (0, n // 2, n - 1):
            p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
            p.grad = torch.full((n,), big, dtype=dtype)
            p.grad[at] = bad
            named.append((f"{bad}@{at}", p))
    ok = torch.nn.Parameter(torch.zeros(3, n, dtype=dtype))
    ok.grad = torch.tensor([big, -big, 0.0], dtype=dtype).repeat_interleave(n).view(3, n)
    named.append(("largest", ok))
    expected = [f"parameter '{name}'" for name, _ in named[1:-1]]
    assert nonfinite_grads(named) == expected
    assert nonfinite_grads([named[0], named[-1]]) == []


def test_nonfinite_grads_of_sparse_and_strided_views():
    """A sparse gradient (``nn.Embedding(sparse=True)``) and a non-contiguous one are checked
    too."""
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 3])).sum().backward()
    assert emb.weight.grad.is_sparse
    w = torch.nn.Parameter(torch.zeros(4, 6))
    w.grad = torch.ones(6, 4).t()  # a transposed view
    assert nonfinite_grads([("emb", emb.weight), ("w", w)]) == []
    nan = torch.tensor([[0.0, float("nan"), 0.0, 0.0]])
    emb.weight.grad = torch.sparse_coo_tensor([[2]], nan, (10, 4), check_invariants=True)
    w.grad[1, 5] = float("inf")
    assert nonfinite_grads([("emb", emb.weight), ("w", w)]) == ["parameter 'emb'", "parameter 'w'"]
