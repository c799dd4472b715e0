"""Metrics of a server shared by teams (server/metrics.py): with tokens, a scrape needs a bearer
token of role ``read`` or above, and a token scoped to jobs sees only its jobs' series and the
server-wide ones. Status lists only the elastic memberships of jobs in scope, as it lists jobs.

One server over gRPC (``local_calls=False``), with tokens: team A trains ``team-a-job`` a step,
team B trains ``team-b-job`` a step and joins it as an elastic job. The metrics endpoint is
scraped with each kind of token, and with none.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient, StepArgs
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer

parser = pytest.importorskip("prometheus_client.parser")
pytestmark = pytest.mark.timeout(120)

SHARD = "/paramshard.v1.Shard/"
TOKENS = {
    "root": "admin",
    "a-read": "read jobs=team-a-*",
    "b-train": "train jobs=team-b-*",
    "peer-1": "peer",
}
N = 16


@pytest.fixture(scope="module")
def server() -> Iterator[ShardServer]:
    with ShardServer(tokens=TOKENS, metrics_port=0, local_calls=False) as s:
        for token, job in (("root", "team-a-job"), ("b-train", "team-b-job")):
            c = ShardClient(ClusterSpec([s.address], token=token), timeout_s=10, retries=0)
            try:
                c.register_buffer(job, "w", N, optimizer="sgd", hyper={"lr": 0.5})
                c.set_params(job, "w", np.zeros(N, np.float32))
                c.push_grads(job, "w", np.ones(N, np.float32), 0)
                c.step(job, 0, {"w": StepArgs({"lr": 0.5})})
            finally:
                c.close()
        join = pb.JoinRequest(
            run="team-b-run",
            job="team-b-job",
            rank=0,
            world_size=1,
            step=1,
            min_members=1,
            window_ms=10,
            known_members=[0],  # a new job: its coordinator would ask for them (send_known)
        )
        assert call(s, "Join", join, "b-train", pb.JoinReply).member
        yield s


def call(s: ShardServer, method: str, request: object, token: str, reply: type) -> object:
    with grpc.insecure_channel(s.address) as chan:
        stub = chan.unary_unary(
            SHARD + method,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=reply.FromString,
        )
        return stub(request, timeout=10, metadata=(("authorization", f"Bearer {token}"),))


def scrape(s: ShardServer, header: str | None) -> tuple[int, dict[str, str], str]:
    """(HTTP status, headers, body) of one scrape with ``Authorization: header``."""
    req = urllib.request.Request(s.metrics_url, headers={"Authorization": header} if header else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def jobs_named(text: str) -> dict[str, set[str]]:
    """{family name: the jobs its samples name} of a scrape's text."""
    out: dict[str, set[str]] = {}
    for family in parser.text_string_to_metric_families(text):
        named = {s.labels["job"] for s in family.samples if "job" in s.labels}
        if named:
            out[family.name] = named
    return out


@pytest.mark.parametrize(
    "header",
    [None, "Bearer nope", "Basic cm9vdDpyb290", "Bearer", "root", "Bearer root extra"],
    ids=["none", "unknown", "basic", "empty", "no-scheme", "junk-after"],
)
def test_a_scrape_without_a_known_token_is_refused(server: ShardServer, header: str) -> None:
    status, headers, body = scrape(server, header)
    assert status == 401, (status, body)
    assert headers["WWW-Authenticate"] == 'Bearer realm="paramshard"'
    assert "bearer token" in body and "team-" not in body


def test_the_servers_own_token_may_not_scrape(server: ShardServer) -> None:
    status, _, body = scrape(server, "Bearer peer-1")
    assert status == 403 and "'peer'" in body and "team-" not in body


def test_each_token_sees_its_jobs_and_the_server_wide_series(server: ShardServer) -> None:
    seen = {}
    for token in ("root", "a-read", "b-train"):
        status, _, text = scrape(server, f"bearer {token}")  # the scheme in any case
        assert status == 200, text
        seen[token] = jobs_named(text)
        assert "paramshard_uptime_seconds" in text and "paramshard_held_bytes" in text, token
        assert "paramshard_rpc_request_bytes_total" in text, token  # by method: no job
    everyone = {"team-a-job", "team-b-job"}
    assert seen["root"]["paramshard_buffer_version"] == everyone
    assert seen["root"]["paramshard_elastic_members"] == {"team-b-job"}
    assert set().union(*seen["a-read"].values()) == {"team-a-job"}
    assert seen["a-read"]["paramshard_buffer_version"] == {"team-a-job"}
    assert set().union(*seen["b-train"].values()) == {"team-b-job"}
    assert seen["b-train"]["paramshard_elastic_members"] == {"team-b-job"}


def test_status_lists_only_the_memberships_in_scope(server: ShardServer) -> None:
    expected = {"root": {"team-b-job"}, "a-read": set(), "b-train": {"team-b-job"}}
    for token, jobs in expected.items():
        reply = call(server, "Status", pb.StatusRequest(), token, pb.StatusReply)
        assert {m.job for m in reply.memberships} == jobs, token
