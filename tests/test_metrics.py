"""Prometheus metrics of a shard server (``ShardServer(metrics_port=...)``, ``serve
--metrics-port``): byte counters and latency by method, held bytes by kind, step times."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient, StepArgs
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb
from paramshard.server import MALLOC_ENV, ShardServer

parser = pytest.importorskip("prometheus_client.parser")

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def scrape(url: str, token: str = "") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape (with a server's ``token``)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def metered() -> Iterator[ShardServer]:
    with ShardServer(metrics_port=0) as s:
        yield s


@pytest.fixture
def client(metered: ShardServer) -> Iterator[ShardClient]:
    c = ShardClient(ClusterSpec([metered.address]), timeout_s=10.0, retries=0)
    yield c
    c.close()


def test_counters_move_with_pushes_and_pulls(metered: ShardServer, client: ShardClient) -> None:
    n = 10_000
    assert metered.metrics_url and metered.metrics_url.endswith("/metrics")
    client.register_buffer("job", "w", n, optimizer="adam", hyper={"lr": 1e-3})
    client.set_params("job", "w", np.ones(n, np.float32))
    before = scrape(metered.metrics_url)

    for step in range(2):
        client.push_grads("job", "w", np.ones(n, np.float32), step=step)
        client.step("job", step, {"w": StepArgs({"lr": 1e-3})})
        client.pull_params("job", "w", n, min_version=step + 1)
    after = scrape(metered.metrics_url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("paramshard_rpc_request_bytes_total", method="PushGrad") >= 2 * n * 4
    assert delta("paramshard_rpc_response_bytes_total", method="PullParams") >= 2 * n * 4
    assert 0 < delta("paramshard_rpc_request_bytes_total", method="PullParams") < 200
    assert delta("paramshard_rpc_request_bytes_total", method="Step") > 0
    for method in ("PushGrad", "Step", "PullParams"):
        assert delta("paramshard_rpc_duration_seconds_count", method=method, code="OK") == 2
        assert delta("paramshard_rpc_duration_seconds_sum", method=method, code="OK") > 0
        inf = value(
            after, "paramshard_rpc_duration_seconds_bucket", method=method, code="OK", le="+Inf"
        )
        assert inf == value(
            after, "paramshard_rpc_duration_seconds_count", method=method, code="OK"
        )

    # computed from the store at scrape time
    assert value(after, "paramshard_held_bytes", kind="params") == n * 4
    assert value(after, "paramshard_held_bytes", kind="grads") == n * 4
    assert value(after, "paramshard_held_bytes", kind="optimizer") >= 2 * n * 4  # Adam: m, v
    assert value(after, "paramshard_held_bytes", kind="slots") == 0
    assert value(after, "paramshard_buffer_version", job="job", buffer="w") == 2
    assert value(after, "paramshard_last_step_seconds", job="job", buffer="w") > 0
    assert value(after, "paramshard_jobs") == 1 and value(after, "paramshard_buffers") == 1
    assert value(after, "process_resident_memory_bytes") > 0


def test_failed_calls_are_timed_with_their_code(metered: ShardServer, client: ShardClient) -> None:
    with pytest.raises(ShardClientError):
        client.pull_params("no-such-job", "w", 4)
    client.all_reduce(np.arange(8.0))  # an all-reduce: ContributeRead
    samples = scrape(metered.metrics_url)
    count = "paramshard_rpc_duration_seconds_count"
    assert value(samples, count, method="PullParams", code="NOT_FOUND") == 1
    assert value(samples, count, method="ContributeRead", code="OK") >= 1


def test_rejected_calls_are_counted() -> None:
    with ShardServer(metrics_port=0, tokens={"r": "read"}) as s:
        c = ShardClient(ClusterSpec([s.address], token="r"), timeout_s=10.0, retries=0)
        try:
            with pytest.raises(ShardClientError):
                c.register_buffer("j", "w", 4)
            c.call(0, "Status", pb.StatusRequest())
        finally:
            c.close()
        samples = scrape(s.metrics_url, token="r")  # a server with tokens asks for one
    count = "paramshard_rpc_duration_seconds_count"
    assert value(samples, count, method="RegisterBuffer", code="PERMISSION_DENIED") == 1
    assert value(samples, count, method="Status", code="OK") == 1


def test_servers_in_one_process_keep_their_own_metrics(metered: ShardServer) -> None:
    with ShardServer(metrics_port=0) as other:
        c = ShardClient(ClusterSpec([other.address]), timeout_s=10.0, retries=0)
        try:
            c.status()
        finally:
            c.close()
        count = "paramshard_rpc_duration_seconds_count"
        assert value(scrape(other.metrics_url), count, method="Status", code="OK") == 1
        assert value(scrape(metered.metrics_url), count, method="Status", code="OK") == 0


def test_only_metrics_path_is_served(metered: ShardServer) -> None:
    assert metered.metrics_url is not None
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(metered.metrics_url.replace("/metrics", "/secret"), timeout=10)
    assert info.value.code == 404


def test_no_metrics_unless_asked() -> None:
    with ShardServer() as s:
        assert s.metrics is None and s.metrics_url is None


def test_metrics_stop_with_the_server() -> None:
    s = ShardServer(metrics_port=0).start()
    url = s.metrics_url
    assert url is not None
    scrape(url)
    s.stop(0)
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)


def test_serve_metrics_port() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in MALLOC_ENV and not k.startswith("PARAMSHARD_")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "paramshard", "serve", "--port", "0", "--metrics-port", "0"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(
        target=lambda: [lines.put(line.rstrip("\n")) for line in proc.stdout],  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()
    try:
        listening = lines.get(timeout=20)
        assert listening.startswith("paramshard serve: listening on 127.0.0.1:")
        address = listening.split()[4]
        metrics_line = lines.get(timeout=10)
        match = re.fullmatch(
            r"paramshard serve: metrics at (http://127\.0\.0\.1:\d+/metrics)", metrics_line
        )
        assert match, metrics_line
        c = ShardClient(ClusterSpec([address]), timeout_s=10.0, retries=0)
        try:
            c.register_buffer("j", "w", 100, optimizer="sgd")
        finally:
            c.close()
        samples = scrape(match.group(1))
        assert value(samples, "paramshard_held_bytes", kind="params") == 400
        assert (
            value(
                samples, "paramshard_rpc_duration_seconds_count", method="RegisterBuffer", code="OK"
            )
            == 1
        )
    finally:
        proc.kill()
        proc.wait(timeout=10)
