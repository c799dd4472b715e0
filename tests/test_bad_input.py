"""Bad input: malformed bytes on every method, semantic errors with documented codes, fuzzing.

A rejected request must get its documented status code with a message naming the thing, change
nothing, and leave the server answering.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramshard.client import ClusterSpec, ShardClient, ShardClientError, StepArgs
from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer

METHODS = [
    "RegisterBuffer",
    "SetParams",
    "PushGrad",
    "PullParams",
    "GradNorm",
    "Step",
    "Contribute",
    "ReadSlot",
    "ContributeRead",
    "DropJob",
    "Status",
]
JOB, BUF, NUMEL = "badjob", "buf", 10
CRASHES = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}


@pytest.fixture(scope="module")
def server() -> Iterator[ShardServer]:
    """One server for this module, with a job 'badjob' holding buffer 'buf' (10 elements)."""
    s = ShardServer().start()
    c = ShardClient(ClusterSpec([s.address]), timeout_s=10)
    c.register_buffer(JOB, BUF, NUMEL, hyper={"lr": 0.1})
    c.set_params(JOB, BUF, np.arange(NUMEL, dtype=np.float32))
    c.close()
    yield s
    s.stop(0)


@pytest.fixture(scope="module")
def channel(server: ShardServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as chan:
        yield chan


def raw(channel: grpc.Channel, method: str, payload: bytes, timeout: float = 5.0) -> tuple:
    """Sends raw bytes; returns (status code, details, reply bytes or None)."""
    stub = channel.unary_unary(
        "/paramshard.v1.Shard/" + method,
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    try:
        return grpc.StatusCode.OK, "", stub(payload, timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code(), exc.details(), None


def status_ok(channel: grpc.Channel) -> pb.StatusReply:
    code, details, reply = raw(channel, "Status", b"")
    assert code == grpc.StatusCode.OK, details
    return pb.StatusReply.FromString(reply)


def rpc_error(fn: Any, *args: Any, **kw: Any) -> ShardClientError:
    with pytest.raises(ShardClientError) as info:
        fn(*args, **kw)
    return info.value


def make_client(addresses: list[str], rank: int = 0, world: int = 1, **kw: Any) -> ShardClient:
    kw.setdefault("timeout_s", 5.0)
    return ShardClient(ClusterSpec(list(addresses)), rank=rank, world_size=world, **kw)


@pytest.fixture
def c(server: ShardServer) -> Iterator[ShardClient]:
    cl = make_client([server.address])
    yield cl
    cl.close()


# --- malformed bytes, every method -----------------------------------------------------------


def valid_request(method: str) -> bytes:
    """A well-formed request whose last field is length-delimited (so a cut truncates it)."""
    ref = pb.BufferRef(job=JOB, buffer=BUF)
    chunk = pb.Chunk(offset=0, numel=2, dtype=pb.FLOAT32)
    payload = np.ones(2, np.float32)
    return {
        "RegisterBuffer": pb.RegisterBufferRequest(
            ref=ref,
            numel=NUMEL,
            num_servers=1,
            contributors=1,
            optimizer=pb.OptimizerSpec(name="sgd"),
        ).SerializeToString(),
        "SetParams": codec.encode(pb.SetParamsHeader(ref=ref, chunk=chunk), payload),
        "PushGrad": codec.encode(pb.PushGradHeader(ref=ref, chunk=chunk, num_micro=1), payload),
        "PullParams": pb.PullParamsRequest(ref=ref, chunk=chunk).SerializeToString(),
        "GradNorm": pb.GradNormRequest(job=JOB, buffers=[BUF]).SerializeToString(),
        "Step": pb.StepRequest(job=JOB, buffers=[pb.BufferStep(buffer=BUF)]).SerializeToString(),
        "Contribute": codec.encode(
            pb.SlotHeader(
                key="k", expected=1, readers=1, total_numel=2, chunk_numel=2, chunk=chunk
            ),
            payload,
        ),
        "ReadSlot": pb.ReadSlotRequest(key="k").SerializeToString(),
        "ContributeRead": codec.encode(
            pb.SlotHeader(
                key="kr", expected=1, readers=1, total_numel=2, chunk_numel=2, chunk=chunk
            ),
            payload,
        ),
        "DropJob": pb.DropJobRequest(job=JOB).SerializeToString(),
        "Status": b"",
    }[method]


GARBAGE = {
    "unterminated varint": b"\xff" * 9,
    "random bytes": bytes(np.random.default_rng(1).integers(0, 256, 300, dtype=np.uint8)),
    "huge declared length (field 1)": b"\x0a\xff\xff\xff\xff\x0f" + b"abc",
    "huge declared length (field 15)": b"\x7a\xff\xff\xff\xff\xff\xff\xff\xff\x01" + b"abc",
    "huge length of an unknown field": b"\x5a\xff\xff\xff\xff\x07" + b"x" * 10,
    "field number 0": b"\x00\x01",
    "bad wire type": b"\x0f\x01",
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", list(GARBAGE))
def test_garbage_is_invalid_argument(channel: grpc.Channel, method: str, kind: str) -> None:
    code, details, _ = raw(channel, method, GARBAGE[kind])
    if method == "Status" and code == grpc.StatusCode.OK:
        pass  # StatusRequest has no fields: the runtime may skip what it does not know
    else:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert method in details
    status_ok(channel)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "Status"])
def test_truncated_valid_message_is_invalid_argument(channel: grpc.Channel, method: str) -> None:
    whole = valid_request(method)
    for cut in (1, 2):  # inside the last field
        code, details, _ = raw(channel, method, whole[:-cut], timeout=2)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (cut, code, details)
    status_ok(channel)


def test_status_ignores_well_formed_unknown_fields(channel: grpc.Channel) -> None:
    code, details, reply = raw(channel, "Status", b"\x08\x01\x12\x03abc")
    assert code == grpc.StatusCode.OK, details
    assert pb.StatusReply.FromString(reply).version


def test_unknown_method_is_unimplemented(channel: grpc.Channel) -> None:
    code, _, _ = raw(channel, "Shutdown", b"")
    assert code == grpc.StatusCode.UNIMPLEMENTED
    status_ok(channel)


# --- unknown things ------------------------------------------------------------------------


def test_unknown_job_and_buffer_are_not_found(c: ShardClient) -> None:
    g = np.ones(NUMEL, np.float32)
    for job, buf, named in (("nosuchjob", BUF, "nosuchjob"), (JOB, "nosuchbuf", "nosuchbuf")):
        calls = {
            "SetParams": lambda j=job, b=buf: c.set_params(j, b, g),
            "PushGrad": lambda j=job, b=buf: c.push_grads(j, b, g, 0),
            "PullParams": lambda j=job, b=buf: c.pull_params(j, b, NUMEL),
            "GradNorm": lambda j=job, b=buf: c.grad_sum_squares(j, [b], 0),
            "Step": lambda j=job, b=buf: c.step(j, 0, {b: StepArgs({"lr": 0.1})}),
        }
        for method, call in calls.items():
            err = rpc_error(call)
            assert err.code == grpc.StatusCode.NOT_FOUND, (method, err)
            assert err.method == method and named in err.details
    err = rpc_error(c.call, 0, "DropJob", pb.DropJobRequest(job="nosuchjob"))
    assert err.code == grpc.StatusCode.NOT_FOUND and "nosuchjob" in err.details
    np.testing.assert_array_equal(c.pull_params(JOB, BUF, NUMEL), np.arange(NUMEL))


# --- fuzzing ---------------------------------------------------------------------------------

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(method=st.sampled_from(["PushGrad", "Contribute"]), data=st.binary(max_size=200))
def test_fuzz_random_bytes(channel: grpc.Channel, method: str, data: bytes) -> None:
    code, details, _ = raw(channel, method, data, timeout=5)
    assert code not in CRASHES, (code, details)


small = st.integers(0, 12)
anything = st.one_of(small, st.integers(0, 2**64 - 1))
floats = st.one_of(st.floats(), st.sampled_from([0.0, 0.1, -1.0, 1e308]))


@st.composite
def push_messages(draw: Any) -> bytes:
    args = draw(
        st.none()
        | st.builds(
            pb.StepArgs,
            hyper=st.dictionaries(
                st.sampled_from(["lr", "momentum", "nesterov", "bogus"]), floats, max_size=2
            ),
            clip_coef=floats,
        )
    )
    header = pb.PushGradHeader(
        ref=pb.BufferRef(job=draw(st.sampled_from([JOB, "fuzz-none"])), buffer=BUF),
        chunk=pb.Chunk(offset=draw(anything), numel=draw(small), dtype=draw(st.integers(0, 8))),
        step=draw(st.integers(0, 3)),
        contributor=draw(st.integers(0, 3)),
        micro=draw(st.integers(0, 3)),
        num_micro=draw(st.integers(0, 3)),
        step_args=args,
    )
    return codec.encode(header, draw(payloads(header.chunk)))


def payloads(chunk: pb.Chunk) -> st.SearchStrategy[bytes]:
    try:
        size = chunk.numel * codec.numpy_dtype(chunk.dtype).itemsize
    except ValueError:
        size = chunk.numel * 4
    return st.one_of(st.binary(min_size=size, max_size=size), st.binary(max_size=40))


@st.composite
def contribute_messages(draw: Any) -> bytes:
    header = pb.SlotHeader(
        key=draw(st.sampled_from(["f1", "f2", ""])),
        op=draw(st.integers(0, 6)),
        expected=draw(st.integers(0, 3)),
        readers=draw(st.integers(0, 3)),
        total_numel=draw(small),
        shape=draw(st.lists(st.integers(-3, 5), max_size=3)),
        chunk=pb.Chunk(offset=draw(small), numel=draw(small), dtype=draw(st.integers(0, 8))),
        contributor=draw(st.integers(0, 3)),
        chunk_numel=draw(small),
    )
    return codec.encode(header, draw(payloads(header.chunk)))


@FUZZ
@given(message=push_messages())
def test_fuzz_push_grad_headers(channel: grpc.Channel, message: bytes) -> None:
    code, details, _ = raw(channel, "PushGrad", message, timeout=5)
    assert code not in CRASHES, (code, details)


@FUZZ
@given(message=contribute_messages())
def test_fuzz_contribute_headers(channel: grpc.Channel, message: bytes) -> None:
    code, details, _ = raw(channel, "Contribute", message, timeout=5)
    assert code not in CRASHES, (code, details)


def test_server_still_serves_after_fuzzing(channel: grpc.Channel, c: ShardClient) -> None:
    reply = status_ok(channel)
    assert reply.jobs and reply.jobs[0].job == JOB
    assert c.pull_params(JOB, BUF, NUMEL).shape == (NUMEL,)
