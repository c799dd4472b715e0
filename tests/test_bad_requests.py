"""Bad requests that parse: payloads and chunks, registration and optimizer state, each with
its documented status code and a message naming the thing, changing nothing. (Malformed bytes
and fuzzing: tests/test_bad_input.py, whose fixtures these tests share; slots and limits:
tests/test_bad_slots.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import test_bad_input
from test_bad_input import BUF, CRASHES, JOB, NUMEL, make_client, rpc_error

from paramshard.client import ShardClient, ShardClientError, StepArgs
from paramshard.protos import shard_pb2 as pb

server = test_bad_input.server  # the module's fixtures: one server with JOB/BUF
c = test_bad_input.c

# --- payloads and chunks -------------------------------------------------------------------


def set_params_request(
    offset: int, numel: int, payload: np.ndarray, dtype: int = pb.FLOAT32, version: int = 0
) -> tuple:
    header = pb.SetParamsHeader(
        ref=pb.BufferRef(job=JOB, buffer=BUF),
        version=version,
        chunk=pb.Chunk(offset=offset, numel=numel, dtype=dtype),
    )
    return header, payload


def push_request(
    payload: np.ndarray,
    *,
    offset: int = 0,
    numel: int | None = None,
    dtype: int = pb.FLOAT32,
    step: int = 0,
    contributor: int = 0,
    micro: int = 0,
    num_micro: int = 1,
    job: str = JOB,
    buf: str = BUF,
    step_args: pb.StepArgs | None = None,
) -> tuple:
    numel = payload.size if numel is None else numel
    header = pb.PushGradHeader(
        ref=pb.BufferRef(job=job, buffer=buf),
        step=step,
        contributor=contributor,
        micro=micro,
        num_micro=num_micro,
        chunk=pb.Chunk(offset=offset, numel=numel, dtype=dtype),
        step_args=step_args,
    )
    return header, payload


def unchanged(c: ShardClient, job: str = JOB, buf: str = BUF, numel: int = NUMEL) -> tuple:
    """The buffer's values and version, to compare before and after a rejected request."""
    (row,) = c.status()
    version = next(
        int(b["version"])
        for j in row["jobs"]
        if j["job"] == job
        for b in j["buffers"]
        if b["buffer"] == buf
    )
    return c.pull_params(job, buf, numel).tobytes(), version


@pytest.mark.parametrize(("numel", "payload_elems"), [(10, 9), (9, 10), (2, 0), (0, 1)])
def test_set_params_payload_size_mismatch(c: ShardClient, numel: int, payload_elems: int) -> None:
    before = unchanged(c)
    req = set_params_request(0, numel, np.full(payload_elems, 7.0, np.float32), version=4)
    err = rpc_error(c.call, 0, "SetParams", req)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{JOB}/{BUF}" in err.details and f"{payload_elems * 4:,} bytes" in err.details
    assert unchanged(c) == before  # neither values nor version moved


def test_set_params_chunk_outside_slice_and_bad_dtype(c: ShardClient) -> None:
    before = unchanged(c)
    for offset, numel in ((9, 2), (10, 1), (2**63, 1)):
        err = rpc_error(
            c.call, 0, "SetParams", set_params_request(offset, numel, np.zeros(numel, np.float32))
        )
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "outside this server's slice of 10 elements" in err.details
    err = rpc_error(
        c.call, 0, "SetParams", set_params_request(0, 2, np.zeros(2, np.int64), dtype=pb.INT64)
    )
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in err.details
    err = rpc_error(
        c.call,
        0,
        "PullParams",
        pb.PullParamsRequest(
            ref=pb.BufferRef(job=JOB, buffer=BUF),
            chunk=pb.Chunk(offset=5, numel=6, dtype=pb.FLOAT32),
        ),
    )
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "outside" in err.details
    err = rpc_error(
        c.call,
        0,
        "PullParams",
        pb.PullParamsRequest(
            ref=pb.BufferRef(job=JOB, buffer=BUF), chunk=pb.Chunk(offset=0, numel=2, dtype=99)
        ),
    )
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert unchanged(c) == before


@pytest.fixture
def fresh(servers) -> Iterator[tuple[ShardClient, str]]:
    """A client (2 contributors) on a fresh server with buffer JOB/BUF initialised to 0..9."""
    (s,) = servers(1)
    cl = make_client([s.address], 0, 2)
    cl.register_buffer(JOB, BUF, NUMEL, hyper={"lr": 0.5})
    cl.set_params(JOB, BUF, np.arange(NUMEL, dtype=np.float32))
    yield cl, s.address
    cl.close()


def test_rejected_pushes_change_nothing(fresh: tuple[ShardClient, str]) -> None:
    c, _ = fresh
    g = np.ones(NUMEL, np.float32)
    bad = {
        "payload size": (
            push_request(g[:9], numel=10),
            grpc.StatusCode.INVALID_ARGUMENT,
            "payload has 36 bytes",
        ),
        "chunk outside slice": (
            push_request(g[:3], offset=8),
            grpc.StatusCode.INVALID_ARGUMENT,
            "outside",
        ),
        "contributor": (
            push_request(g, contributor=2),
            grpc.StatusCode.INVALID_ARGUMENT,
            "contributor 2 is outside 0..1",
        ),
        "micro": (
            push_request(g, micro=2, num_micro=2),
            grpc.StatusCode.INVALID_ARGUMENT,
            "micro-batch 2",
        ),
        "num_micro 0": (
            push_request(g, num_micro=0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "num_micro=0",
        ),
        "integer dtype": (
            push_request(g.astype(np.int32), dtype=pb.INT32),
            grpc.StatusCode.INVALID_ARGUMENT,
            "dtype",
        ),
        "future step": (push_request(g, step=1), grpc.StatusCode.FAILED_PRECONDITION, "version 0"),
        "bad lr": (
            push_request(g, step_args=pb.StepArgs(hyper={"lr": -1.0})),
            grpc.StatusCode.INVALID_ARGUMENT,
            "lr",
        ),
        "nan lr": (
            push_request(g, step_args=pb.StepArgs(hyper={"lr": float("nan")})),
            grpc.StatusCode.INVALID_ARGUMENT,
            "lr",
        ),
        "unknown hyper": (
            push_request(g, step_args=pb.StepArgs(hyper={"betas": 0.9})),
            grpc.StatusCode.INVALID_ARGUMENT,
            "betas",
        ),
        "negative clip": (
            push_request(g, step_args=pb.StepArgs(clip_coef=-1.0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "clip_coef",
        ),
        "nan clip": (
            push_request(g, step_args=pb.StepArgs(clip_coef=float("inf"))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "clip_coef",
        ),
    }
    before = unchanged(c)
    for name, (req, code, text) in bad.items():
        err = rpc_error(c.call, 0, "PushGrad", req)
        assert err.code == code, (name, err)
        assert text in err.details, (name, err.details)
        if code == grpc.StatusCode.INVALID_ARGUMENT and name != "integer dtype":
            assert f"{JOB}/{BUF}" in err.details, name
    assert unchanged(c) == before
    # none of them was counted: two good pushes (one per contributor) make exactly one step
    first = c.call(0, "PushGrad", push_request(g, contributor=0))
    assert not first.duplicate and not first.reduced
    last = c.call(
        0, "PushGrad", push_request(3 * g, contributor=1, step_args=pb.StepArgs(hyper={"lr": 0.5}))
    )
    assert last.reduced and last.version == 1
    np.testing.assert_array_equal(
        c.pull_params(JOB, BUF, NUMEL, 1), np.arange(NUMEL, dtype=np.float32) - 0.5 * 2.0
    )


def test_num_micro_must_agree_within_a_step(fresh: tuple[ShardClient, str]) -> None:
    c, _ = fresh
    g = np.ones(NUMEL, np.float32)
    c.call(0, "PushGrad", push_request(g, micro=0, num_micro=2))
    err = rpc_error(c.call, 0, "PushGrad", push_request(g, contributor=1, micro=0, num_micro=3))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and "2 micro-batches" in err.details
    # a retry with another size for the same contribution is refused, not double counted
    err = rpc_error(c.call, 0, "PushGrad", push_request(g[:5], micro=0, num_micro=2))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT


def test_step_and_grad_norm_errors(fresh: tuple[ShardClient, str]) -> None:
    c, _ = fresh
    before = unchanged(c)
    err = rpc_error(c.step, JOB, 1, {BUF: StepArgs({"lr": 0.1})})
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and "version 0" in err.details
    for hyper in ({"lr": -0.1}, {"lr": float("inf")}, {"momentum": -1.0}, {"nesterov": 1.0}):
        err = rpc_error(c.step, JOB, 0, {BUF: StepArgs(hyper)})
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, hyper
        assert f"{JOB}/{BUF}" in err.details, hyper
    err = rpc_error(c.step, JOB, 0, {BUF: StepArgs({"lr": 0.1}, clip_coef=float("nan"))})
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "clip_coef" in err.details
    assert unchanged(c) == before
    # the step still happens normally afterwards
    g = np.ones(NUMEL, np.float32)
    c.call(0, "PushGrad", push_request(g, contributor=0))
    c.call(0, "PushGrad", push_request(g, contributor=1))
    assert c.grad_sum_squares(JOB, [BUF], 0) == [10.0]
    c.step(JOB, 0, {BUF: StepArgs({"lr": 0.5})})
    np.testing.assert_array_equal(
        c.pull_params(JOB, BUF, NUMEL, 1), np.arange(NUMEL, dtype=np.float32) - 0.5
    )
    # the norm of the step just applied is kept for slower ranks; older ones are gone
    assert c.grad_sum_squares(JOB, [BUF], 0) == [10.0]
    args = pb.StepArgs(hyper={"lr": 0.5})
    c.call(0, "PushGrad", push_request(g, step=1, contributor=0, step_args=args))
    c.call(0, "PushGrad", push_request(g, step=1, contributor=1, step_args=args))
    assert c.grad_sum_squares(JOB, [BUF], 1) == [10.0]
    err = rpc_error(c.grad_sum_squares, JOB, [BUF], 0)
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and "already applied" in err.details


def test_register_buffer_errors(c: ShardClient) -> None:
    def register(**kw: Any) -> ShardClientError:
        req = pb.RegisterBufferRequest(
            ref=pb.BufferRef(job="regjob", buffer="b"),
            numel=10,
            num_servers=1,
            server_index=0,
            contributors=1,
            optimizer=pb.OptimizerSpec(name="sgd"),
        )
        for k, v in kw.items():
            if k == "optimizer":
                req.optimizer.CopyFrom(v)
            elif k == "params":
                req.params.extend(v)
            elif k == "ref":
                req.ref.CopyFrom(v)
            else:
                setattr(req, k, v)
        return rpc_error(c.call, 0, "RegisterBuffer", req)

    cases = {
        "unknown optimizer": ({"optimizer": pb.OptimizerSpec(name="lion")}, "lion"),
        "bad lr": ({"optimizer": pb.OptimizerSpec(name="sgd", hyper={"lr": -1.0})}, "lr"),
        "nan eps": (
            {"optimizer": pb.OptimizerSpec(name="adam", hyper={"eps": float("nan")})},
            "eps",
        ),
        "bad beta": ({"optimizer": pb.OptimizerSpec(name="adam", hyper={"beta1": 1.0})}, "beta1"),
        "unknown hyper": ({"optimizer": pb.OptimizerSpec(name="sgd", hyper={"betas": 1})}, "betas"),
        "no job": ({"ref": pb.BufferRef(job="", buffer="b")}, "job name"),
        "server index": ({"server_index": 1}, "server_index 1"),
        "no servers": ({"num_servers": 0}, "server_index"),
        "no contributors": ({"contributors": 0}, "contributors"),
        "param past end": (
            {"params": [pb.ParamEntry(name="w", shape=[4], offset=8, numel=4)]},
            "'w'",
        ),
        "shape and numel": ({"params": [pb.ParamEntry(name="w", shape=[2, 2], numel=5)]}, "'w'"),
        "split index": (
            {"params": [pb.ParamEntry(name="w", shape=[4], numel=4, split_parts=2, split_index=2)]},
            "part 2 of 2",
        ),
        "split dim": (
            {"params": [pb.ParamEntry(name="w", shape=[4], numel=4, split_parts=2, split_dim=1)]},
            "along dim 1",
        ),
    }
    for name, (kw, text) in cases.items():
        err = register(**kw)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, (name, err)
        assert text in err.details, (name, err.details)
    (row,) = c.status()
    assert "regjob" not in [j["job"] for j in row["jobs"]]


def test_register_rejects_negative_dimensions(c: ShardClient) -> None:
    req = pb.RegisterBufferRequest(
        ref=pb.BufferRef(job="negjob", buffer="b"),
        numel=5,
        num_servers=1,
        contributors=1,
        optimizer=pb.OptimizerSpec(name="sgd"),
        params=[pb.ParamEntry(name="w", shape=[-1, -5], numel=5)],
    )
    err = rpc_error(c.call, 0, "RegisterBuffer", req)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "'w'" in err.details


def test_register_refuses_a_second_placement_of_a_job(c: ShardClient) -> None:
    """Every buffer of a job on a server is the same slice of the same number of servers:
    Status reports one placement per job, which the tools rely on to find a job's servers."""

    def req(buffer: str, index: int, count: int) -> pb.RegisterBufferRequest:
        return pb.RegisterBufferRequest(
            ref=pb.BufferRef(job="placejob", buffer=buffer),
            numel=4,
            num_servers=count,
            server_index=index,
            contributors=1,
            optimizer=pb.OptimizerSpec(name="sgd"),
        )

    c.call(0, "RegisterBuffer", req("a", 1, 2))
    for index, count in ((0, 2), (1, 3)):
        err = rpc_error(c.call, 0, "RegisterBuffer", req("b", index, count))
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "slice 1 of 2" in err.details and f"{index} of {count}" in err.details
    (job,) = [j for j in c.call(0, "Status", pb.StatusRequest()).jobs if j.job == "placejob"]
    assert [b.buffer for b in job.buffers] == ["a"]  # nothing registered
    assert (job.server_index, job.num_servers) == (1, 2)


@pytest.mark.parametrize("numel", [2**45, 2**62], ids=["128TiB", "huge"])
def test_register_unallocatable_buffer(c: ShardClient, numel: int) -> None:
    err = rpc_error(c.register_buffer, "hugejob", "b", numel)
    assert err.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
    assert "hugejob/b" in err.details


# --- optimizer state reads and writes ----------------------------------------------------------


def test_optimizer_state_errors_leave_the_buffer_unchanged(c: ShardClient) -> None:
    """The module's buffer runs plain SGD (no momentum): it has no state to read or write."""
    before = c.pull_params(JOB, BUF, NUMEL)
    out = np.empty(NUMEL, dtype=np.float32)
    cases = [
        (lambda: c.run(c.pull_calls(JOB, BUF, out, 0, state="exp_avg")), "unknown state"),
        (lambda: c.run(c.pull_calls(JOB, BUF, out, 0, state="momentum_buffer")), "does not exist"),
        (
            lambda: c.set_params(JOB, BUF, out, version=0, state="momentum_buffer"),
            "not used with these hyper-parameters",
        ),
        (lambda: c.set_params(JOB, BUF, out, version=0, state="sum"), "unknown state"),
        (lambda: c.set_params(JOB, BUF, out, version=7, state="x"), "version 7"),
    ]
    for call, text in cases:
        err = rpc_error(call)
        assert err.code not in CRASHES, err
        assert text in err.details, err.details
    np.testing.assert_array_equal(c.pull_params(JOB, BUF, NUMEL), before)
    assert c.optimizer_state_info(JOB)[BUF] == ([], 0)
