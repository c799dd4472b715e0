"""Tokens scoped to jobs and runs, piece by piece (server/rpc/scopes.py, server/rpc/tokens.py):
the patterns, token file lines, the pre-parse that names a request's job or run before it is
parsed, and the table docs/security.md shows. tests/test_token_scopes.py calls every method
through a real server with each team's tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paramshard.protos import shard_pb2 as pb
from paramshard.server.config import SecurityConfig
from paramshard.server.rpc import scopes
from paramshard.server.rpc.access_table import markdown
from paramshard.server.rpc.scopes import Grant, Scope
from paramshard.server.rpc.tokens import parse_token_file

ROOT = Path(__file__).resolve().parents[1]
METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["Shard"].methods]


def test_patterns_and_runs() -> None:
    scope = scopes.parse_scope(["jobs=team-a-*,eval"])
    assert scope == Scope(jobs=("team-a-*", "eval"), runs=("team-a-*", "eval"))
    assert scope.allows_job("team-a-x") and scope.allows_job("eval")
    assert not scope.allows_job("team-a") and not scope.allows_job("eval2")
    assert not scope.allows_job("team-b-x") and not scope.allows_job("")
    # an exact run covers its groups and epochs, not a run whose id merely starts with it
    for run, inside in (("eval", True), ("eval/g", True), ("eval.e3", True),
                        ("eval.e3/g", True), ("evalx", False), ("eval.ex", False)):  # fmt: skip
        assert scope.allows_run(run) is inside, run
    assert scopes.parse_scope(["runs=r1", "jobs=j*"]) == Scope(jobs=("j*",), runs=("r1",))
    assert scopes.parse_scope([]) is None
    assert scopes.parse_scope(["jobs=*"]).allows_job("anything")
    for bad, match in (
        (["jobs="], "needs comma-separated"),
        (["jobs=a,,b"], "needs comma-separated"),
        (["jobs=a*b"], "may only end"),
        (["runs=a:b"], "':'"),
        (["jobs=a", "jobs=b"], "twice"),
        (["teams=a"], "not a scope"),
    ):
        with pytest.raises(ValueError, match=match):
            scopes.parse_scope(bad)


def test_token_lines_and_grants() -> None:
    text = "read r-1 jobs=a/*\ntrain t-1 runs=r\nadmin a-1\npeer p-1\n"
    tokens = parse_token_file(text)
    assert tokens == {
        "r-1": Grant("read", Scope(("a/*",), ("a/*",))),
        "t-1": Grant("train", Scope(("r",), ("r",))),
        "a-1": "admin",
        "p-1": "peer",
    }
    assert parse_token_file("read r-1 jobs=a\nread r-1 jobs=a\n") == {
        "r-1": Grant("read", Scope(("a",), ("a",)))
    }
    for bad, match in (
        ("peer p jobs=a\n", "peer token takes no"),
        ("train t jobs=a\ntrain t jobs=b\n", "same token"),
        ("train t team-a\n", "expected 'ROLE TOKEN'"),
        ("train t jobs=a runs=b jobs=c\n", "twice"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_token_file(bad, "f")
    # {token: role} as before; a scope as a token file writes it, or a Grant
    config = SecurityConfig(tokens={"x": "train", "y": "read jobs=a", "z": Grant("admin")})
    assert dict(config.tokens) == {"x": "train", "y": Grant("read", Scope(("a",), ("a",))),
                                   "z": "admin"}  # fmt: skip
    with pytest.raises(ValueError, match="unknown role"):
        SecurityConfig(tokens={"x": "root jobs=a"})


def test_the_pre_parse_reads_what_protobuf_reads() -> None:
    """For every method whose request names a job or run: random requests (the chaos
    fuzzer's, from the descriptor), alone and concatenated (protobuf merges them), name in
    the pre-parse what the parsed message names."""
    from chaos_requests import random_message
    from chaos_values import Context

    rng = np.random.default_rng(27)
    ctx = Context("127.0.0.1:1")
    service = pb.DESCRIPTOR.services_by_name["Shard"]
    checked = 0
    for method, route in scopes.ROUTES.items():
        if not route.checked:
            continue
        desc = service.methods_by_name[method].input_type
        cls = type(random_message(rng, desc, ctx))
        for _ in range(60):
            parts = [random_message(rng, desc, ctx) for _ in range(int(rng.integers(1, 4)))]
            wire = b"".join(p.SerializeToString() for p in parts)
            parsed: Any = cls.FromString(wire)
            for name in route.path:
                parsed = getattr(parsed, name)
            assert scopes.named(method, wire) == parsed, (method, wire.hex())
            checked += 1
    assert checked == 60 * sum(r.checked for r in scopes.ROUTES.values())


def test_a_parse_that_disagrees_is_refused_too() -> None:
    """The second reading: a parsed request naming another job is refused even if the
    pre-parse had let it through."""
    scope = Scope(("team-a-*",), ("team-a-*",))
    header = pb.PushGradHeader(ref=pb.BufferRef(job="team-b-job"))
    code, details = scopes.mismatch(scope, "PushGrad", (header, memoryview(b"")))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "(as parsed)" in details
    ok = pb.PullParamsRequest(ref=pb.BufferRef(job="team-a-job"))
    assert scopes.mismatch(scope, "PullParams", ok) is None
    drop = scope_drop = Scope(("team-a-*",), ("runs-a/*",))
    assert "run 'team-a-x'" in scopes.refusal(drop, "DropJob", b"\x0a\x08team-a-x")[1]
    assert scopes.refusal(scope_drop, "Status", b"garbage") is None  # names nothing


def test_many_tiny_fields_cost_a_bounded_walk() -> None:
    scope = Scope(("a",), ("a",))
    fine = (
        b"\x18\x01" * (scopes.MAX_SCANNED_FIELDS - 1)
        + pb.GradNormRequest(job="a").SerializeToString()
    )
    assert scopes.refusal(scope, "GradNorm", fine) is None
    code, details = scopes.refusal(scope, "GradNorm", b"\x18\x01" * (scopes.MAX_SCANNED_FIELDS + 1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "fields" in details


def test_serve_reads_scopes_and_says_how(tmp_path: Path) -> None:
    from test_cli import paramshard

    usage = paramshard("serve", "--help").stdout
    assert "jobs=" in usage and "runs=" in usage and "prefix ending in '*'" in usage
    tokens = tmp_path / "tokens"
    tokens.write_text("train t1 jobs=a-*\npeer p1 runs=x\n")
    result = paramshard("serve", "--port", "0", "--token-file", str(tokens))
    assert result.returncode == 2
    assert "line 2: a peer token takes no jobs= or runs=" in result.stderr


def test_the_table_in_docs_is_the_codes() -> None:
    text = (ROOT / "docs" / "security.md").read_text()
    assert markdown() in text, "python -m paramshard.server.rpc.access_table > the table"
    assert set(METHODS) <= {line.split("`")[1] for line in markdown().splitlines()[2:]}
