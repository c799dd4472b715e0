"""Requests larger than their method ever needs are refused before they are parsed
(server/rpc/parsers.py: CONTROL_BYTES for a method that carries no tensor, MODEL_BYTES for the
two that list a model's parameters, HEADER_BYTES for a tensor message's header). Parsing
allocates several times a request's bytes, and a repeated field of one-byte numbers much more:
a read token's ReleaseSegments of 255 MiB took a server from 64 MB to 5.2 GB and held it 19 s
(tests/test_hostile_slots.py), a train token's Contribute header with a 64 MiB shape list
1.2 GB and 0.8 s before it was refused."""

from __future__ import annotations

import grpc
import pytest
from replica_probes import call
from slot_probes import Background, Code, team_server, timed_call, varint, worst_latency

from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.rpc.parsers import CONTROL_BYTES, HEADER_BYTES, MODEL_BYTES

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(servers) -> ShardServer:
    return team_server(servers)


def _field(number: int, body: bytes) -> bytes:
    """Field ``number`` of wire type 2 (length-delimited) holding ``body``."""
    return varint(number << 3 | 2) + varint(len(body)) + body


def _refused_unparsed(server: ShardServer, method: str, raw: bytes, token: str) -> str:
    """The call of ``raw`` is refused INVALID_ARGUMENT within a second, and another caller's
    Status meanwhile waits less than that; returns the refusal's words."""
    big = Background(lambda: timed_call(server.address, method, raw, token))
    worst = worst_latency(server.address, big)
    out, took = big.result()
    assert isinstance(out, grpc.RpcError), f"{method} answered {out}"
    assert out.code() == Code.INVALID_ARGUMENT, out.details()
    assert took < 1.0 and worst < 1.0, (took, worst)
    return out.details()


def _sized(total: int, prefix: bytes = b"") -> bytes:
    """``prefix`` and an unknown field (it would parse), ``total`` bytes in all."""
    pad = total - len(prefix) - len(_field(1000, b""))
    raw = prefix + _field(1000, b"\x00" * pad)
    return prefix + _field(1000, b"\x00" * (pad - (len(raw) - total)))


def test_a_tensor_header_past_the_bound_is_refused_before_it_is_parsed(server) -> None:
    """A Contribute of team A's whose header holds a shape list of 2 x HEADER_BYTES one-byte
    numbers."""
    header = _field(1, b"team-a-r:ag0/0") + _field(6, b"\x01" * (2 * HEADER_BYTES))
    words = _refused_unparsed(server, "Contribute", _field(1, header), "a")
    assert f"a header of {len(header):,} bytes; at most {HEADER_BYTES:,}" in words, words
    assert not call(server.address, "Status", pb.StatusRequest(pending=True)).pending


@pytest.mark.parametrize(
    "method, token, prefix, most",
    [
        ("ReleaseSegments", "a-read", b"", CONTROL_BYTES),
        ("Status", "reader-secret", b"", CONTROL_BYTES),
        # a buffer's parameter list, a snapshot's manifest: MODEL_BYTES
        ("RegisterBuffer", "a", _field(1, _field(1, b"team-a-j") + _field(2, b"w")), MODEL_BYTES),
    ],
)
def test_a_control_request_past_the_bound_is_refused_before_it_is_parsed(
    server, method: str, token: str, prefix: bytes, most: int
) -> None:
    """A request of one byte more than its method's bound, of a method that carries no
    tensor, from a role allowed to call it; a byte less is parsed, and fails or succeeds on
    its merits."""
    raw = _sized(most + 1, prefix)
    assert len(raw) == most + 1
    words = _refused_unparsed(server, method, raw, token)
    assert words == f"{method}: a request of {len(raw):,} bytes; at most {most:,}"
    out, _ = timed_call(server.address, method, _sized(most, prefix), token)
    assert not isinstance(out, grpc.RpcError) or "bytes; at most" not in out.details(), out


def test_a_release_of_more_segments_than_a_caller_holds_is_refused(server) -> None:
    """129 segment ids: a caller holds at most 128, and the set of them is never built."""
    req = pb.ReleaseSegmentsRequest(segments=range(1, 130))
    out = call(server.address, "ReleaseSegments", req, "a-read")
    assert out.code() == Code.INVALID_ARGUMENT
    assert "129 segments named; a caller holds at most 128" in out.details()
    fine = call(server.address, "ReleaseSegments", pb.ReleaseSegmentsRequest(segments=[1]), "a")
    assert isinstance(fine, pb.ReleaseSegmentsReply) and fine.released == 0
