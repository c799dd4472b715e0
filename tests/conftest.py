"""Shared fixtures: in-process shard servers, one ShardClient per rank in threads, markers.

- ``servers(n, **kw)``: starts ``n`` fresh ShardServer on 127.0.0.1:0 (stopped at teardown).
- ``shared_servers``: five servers shared by the whole session (hypothesis tests; every call of
  ``run_ranks`` uses its own run_id, so worlds never share slots).
- ``transport``: runs a test once per way payloads travel (``TRANSPORTS``): calls into a server
  in the same process; gRPC sessions with payloads in shared segments (every payload, however
  small); gRPC sessions with payloads in-band (``PARAMSHARD_SHM=0``; a payload above the
  session's ``MAX_BODY`` goes as its own call); and unary calls with payloads in-band
  (``PARAMSHARD_SESSIONS=0`` too: a server of another host, or one without sessions).
  ``servers`` and ``transport_servers`` (the shared five, or five gRPC-only ones) follow it,
  and the test fails if its calls did not take that path.
- ``run_ranks(fn, world_size, addresses, **client_kw)``: runs ``fn(client)`` for every rank in
  its own thread (LocalCluster's thread runner) and returns the results in rank order; the
  first exception is re-raised.
- Run files (``paramshard launch``) go to a folder of this process's own (``PARAMSHARD_RUN_DIR``),
  so tests in parallel workers (``make test`` runs pytest-xdist) never see each other's runs.
- In an xdist worker, torch (and ``OMP_NUM_THREADS`` for the processes tests start) uses the
  worker's share of the cores.
- ``gpu`` marker: trainers on a GPU; skipped unless torch sees a CUDA device (the servers may
  be NumPy ones). ``cupy`` marker: servers on a GPU; skipped unless CuPy imports and sees one.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from paramshard.client import ClusterSpec, ShardClient
from paramshard.launch_env import omp_threads
from paramshard.local_cluster import RankFailed, run_in_threads
from paramshard.protos import shm as client_shm
from paramshard.server import ShardServer
from paramshard.server.collectives import lease_records
from paramshard.server.collectives.slot import (
    ARRAY_RECORD_BYTES,
    CHUNK_RECORD_BYTES,
    slot_charge,
)

_runs = itertools.count()

# Every pytest process (each xdist worker too) keeps the run files of the launchers its tests
# start in a folder of its own, removed at the end: a tool that looks for "the only live run"
# must not find another worker's, and no test writes into the user's own run directory.
_RUN_DIR = tempfile.mkdtemp(prefix="paramshard-test-runs-")
os.environ["PARAMSHARD_RUN_DIR"] = _RUN_DIR

# Each xdist worker takes its share of the cores for torch's intra-op threads (one each when
# two workers share two cores), and so do the processes its tests start (OMP_NUM_THREADS,
# unless set), by paramshard launch's rule for its ranks: OpenMP threads beyond the cores spin
# and wait for one another, and on a loaded machine a tiny model's forward took 40x longer
# with two threads than with one.
_threads = omp_threads(dict(os.environ), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")))
if _threads is not None:
    import torch

    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_RUN_DIR, ignore_errors=True)


def _torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cupy_cuda() -> bool:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU"
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs = {
        "gpu": (_torch_cuda, "needs a CUDA device for torch"),
        "cupy": (_cupy_cuda, "needs CuPy and a CUDA device"),
    }
    for marker, (available, reason) in needs.items():
        marked = [item for item in items if item.get_closest_marker(marker)]
        if marked and not available():
            for item in marked:
                item.add_marker(pytest.mark.skip(reason=reason))


def _start(n: int, started: list[ShardServer], **kw: Any) -> list[ShardServer]:
    new = [ShardServer("127.0.0.1", 0, **kw).start() for _ in range(n)]
    started.extend(new)
    return new


TRANSPORTS = ("in-process", "shared-memory", "in-band", "unary")


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How this test's payloads travel (module docstring)."""
    if request.param == "shared-memory":
        monkeypatch.setattr(client_shm, "SHM_MIN_BYTES", 1)
    elif request.param in ("in-band", "unary"):
        monkeypatch.setenv("PARAMSHARD_SHM", "0")
    if request.param == "unary":
        monkeypatch.setenv("PARAMSHARD_SESSIONS", "0")
    return request.param


def _counts(started: list[ShardServer]) -> tuple[int, int, int]:
    """Payloads through segments, request payloads in-band, calls in sessions, on
    ``started`` so far."""
    regs = [s.servicer.segments for s in started]
    in_sessions = sum(s.sessions.calls for s in started)
    return sum(r.views for r in regs), sum(r.in_band for r in regs), in_sessions


def _check_path(transport: str, started: list[ShardServer], before: tuple[int, ...]) -> None:
    """Fails a test whose calls did not travel the way ``transport`` says."""
    now = _counts(started)
    views, in_band, in_sessions = (n - b for n, b in zip(now, before, strict=True))
    if transport == "shared-memory":
        assert in_band == 0, f"{in_band} payloads went in-band, not through shared segments"
        assert in_sessions or not views, "payloads went through segments, but not in sessions"
    elif transport in ("in-band", "unary"):
        assert views == 0, f"{views} payloads went through shared segments"
    if transport == "unary":
        assert in_sessions == 0, f"{in_sessions} calls went in sessions"


@pytest.fixture
def servers(request: pytest.FixtureRequest) -> Any:
    """Factory: ``servers(n, **ShardServer_kwargs)`` -> n started servers (stopped afterwards).
    Under ``transport``, through gRPC unless it is "in-process"."""
    started: list[ShardServer] = []
    way = request.getfixturevalue("transport") if "transport" in request.fixturenames else None
    grpc_only = {"local_calls": False} if way not in (None, "in-process") else {}
    yield lambda n, **kw: _start(n, started, **{**grpc_only, **kw})
    try:
        if way is not None:
            _check_path(way, started, (0, 0, 0))
    finally:
        for s in started:
            s.stop(0)


@pytest.fixture(scope="session")
def shared_servers() -> Any:
    """Addresses of five servers shared by the session (use distinct run_ids / job names)."""
    started: list[ShardServer] = []
    _start(5, started)
    yield [s.address for s in started]
    for s in started:
        s.stop(0)


@pytest.fixture(scope="session")
def _grpc_shared_servers() -> Any:
    started: list[ShardServer] = []
    _start(5, started, local_calls=False)
    yield started
    for s in started:
        s.stop(0)


@pytest.fixture
def transport_servers(transport: str, shared_servers: list[str], request: Any) -> Any:
    """``shared_servers`` for the in-process transport, else five shared gRPC-only servers."""
    if transport == "in-process":
        yield shared_servers
        return
    started = request.getfixturevalue("_grpc_shared_servers")
    before = _counts(started)
    yield [s.address for s in started]
    _check_path(transport, started, before)


def slot_held(key: str, *array_bytes: int) -> int:
    """What a server's slot ``key`` of one chunk, holding arrays of ``array_bytes``, is charged
    (``slot_bytes`` in Status, "slots" in the memory budget): its records and its arrays."""
    arrays = sum(n + ARRAY_RECORD_BYTES for n in array_bytes)
    return slot_charge(key) + CHUNK_RECORD_BYTES + arrays


def port_to_reuse() -> int:
    """A free port on 127.0.0.1 for a test that stops a server and starts another at its port:
    one below the kernel's ephemeral range, which no ``:0`` bind nor outgoing connection of a
    parallel test takes in between (one of the range did: "Failed to bind", seen in CI)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below the ephemeral range in 200 tries")


@pytest.fixture(scope="session")
def pki() -> Any:
    """A CA, server and client certificates, and an impostor's CA (tests/pki.py); skips
    without ``cryptography``."""
    from pki import security_pki

    return security_pki()


@pytest.fixture
def pki_files(pki: Any, tmp_path: Any) -> Any:
    """``pki``'s CA, server certificate and key as files, for ``paramshard serve``."""
    from pki import write_server_files

    return write_server_files(pki, tmp_path)


def unique_id(prefix: str = "run") -> str:
    return f"{prefix}{next(_runs)}-{uuid.uuid4().hex[:8]}"


def run_ranks(
    fn: Callable[[ShardClient], Any],
    world_size: int,
    addresses: Sequence[str],
    *,
    run_id: str | None = None,
    wait_s: float = 60.0,
    **client_kw: Any,
) -> list[Any]:
    """``fn(client)`` for ranks 0..world_size-1, each in its own thread with its own client.

    Returns the results in rank order. If a rank raises, the clients are closed (cancelling
    the other ranks' pending calls) and that rank's own exception propagates (noted with the
    rank). Every wait is bounded: the clients' deadline defaults to 20 s and the whole run to
    ``wait_s``. The threads are LocalCluster's (``paramshard.local_cluster.run_in_threads``).
    """
    run_id = run_id or unique_id()
    client_kw.setdefault("timeout_s", 20.0)
    clients = [
        ShardClient(
            ClusterSpec(list(addresses)), rank=r, world_size=world_size, run_id=run_id, **client_kw
        )
        for r in range(world_size)
    ]

    def close_clients() -> None:
        for c in clients:
            c.close()

    try:
        return run_in_threads(
            [functools.partial(fn, c) for c in clients],
            timeout_s=wait_s,
            grace_s=wait_s,
            on_failure=close_clients,
            name=f"rank-{run_id}",
        )
    except RankFailed as failed:
        error = failed.error
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(f"(raised by rank {failed.rank} of {failed.world_size})")
    finally:
        close_clients()
    raise error  # outside the except block: the rank's exception as it was, not chained


@pytest.fixture(name="run_ranks")
def run_ranks_fixture() -> Callable[..., list[Any]]:
    return run_ranks


@pytest.fixture
def job_name(request: pytest.FixtureRequest) -> str:
    """A job name unique to the test (servers may be shared)."""
    return unique_id(request.node.name[:40].replace("[", "_").replace("]", "_") + "-")


def worker_env() -> dict[str, str]:
    """Environment for subprocesses: the repository on the path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def collective_worker(addresses: list[str], rank: int, world_size: int, run_id: str) -> dict:
    """One rank of the multi-process collectives test (top level: picklable for 'spawn')."""
    import numpy as np

    c = ShardClient(
        ClusterSpec(addresses),
        rank=rank,
        world_size=world_size,
        run_id=run_id,
        timeout_s=30.0,
        chunk_bytes=1024,
    )
    try:
        x = np.arange(1001, dtype=np.float32) * (rank + 1)
        out = {"all_reduce": c.all_reduce(x), "max": c.all_reduce(x, op="max")}
        out["all_gather"] = c.all_gather(np.full(rank + 2, rank, dtype=np.int64))
        out["broadcast"] = c.broadcast(x, src=world_size - 1)
        out["reduce_scatter"] = c.reduce_scatter(x)
        c.send(x + 0.5, (rank + 1) % world_size)
        out["recv"] = c.recv((rank - 1) % world_size)
        c.barrier()
        out["pid"] = os.getpid()
        return out
    finally:
        c.close()


@pytest.fixture
def one_torch_thread() -> Any:
    """Ranks as threads of one process: one torch thread each, so they do not oversubscribe
    the two cores (OpenMP spin-waits make a loaded machine many times slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def lease_asks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of ``LeaseRecord.live`` (the lease table's work, counted not timed)."""
    count = [0]
    live = lease_records.LeaseRecord.live

    def counted(self: lease_records.LeaseRecord, now: float) -> bool:
        count[0] += 1
        return live(self, now)

    monkeypatch.setattr(lease_records.LeaseRecord, "live", counted)
    return count
