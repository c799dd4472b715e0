"""``LocalCluster``: N ranks and their shard servers in one Python process (notebooks, unit tests).

    from paramshard import LocalCluster

    def train(config):                      # config: this rank's ShardingConfiguration
        model = DDPModel(make_model(), config)
        ...
        return losses

    with LocalCluster(world_size=4) as cluster:   # 4 in-process servers on 127.0.0.1
        results = cluster.run(train)              # [rank 0's losses, ..., rank 3's]

AiDotNet's ``InMemoryCommunicationBackend`` in torch's shape: each rank is a thread (or, with
``processes=True``, a spawned process talking gRPC to the same servers) holding its own
``ShardClient``. Every ``run`` gets a fresh ``run_id`` and, unless ``job=`` is given, a fresh job
name, so two runs on one cluster never see each other's collectives or buffers.

Thread ranks share one interpreter: torch's global RNG (``torch.manual_seed`` in one rank seeds
them all; give each rank a ``torch.Generator``) and its intra-op thread pool (call
``torch.set_num_threads`` before ``run`` on a small machine). Autograd state is per thread, but
the backward of CUDA tensors runs on torch's one autograd thread per device: thread ranks of
DDP or tensor parallelism on one GPU are refused (strategies/device.py); use ``processes=True``.

``run_in_threads`` is the thread runner ``LocalCluster`` uses; the test suite's ``run_ranks``
uses it too, so there is one way to run ranks as threads.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from types import SimpleNamespace
from typing import Any, TypeVar

from paramshard.local_ranks import RankFailed, RankLeft, all_left, rank_config

__all__ = ["LocalCluster", "RankFailed", "RankLeft", "run_in_threads"]

T = TypeVar("T")

RUN_TIMEOUT_S = 3600.0
"""Default bound on one ``run`` (all ranks); raise it for longer training."""
GRACE_S = 10.0
"""After a rank fails, how long the other thread ranks get to end (their pending calls fail
once their clients are closed, or at their own deadline)."""


def run_in_threads(
    fns: Sequence[Callable[[], T]],
    *,
    timeout_s: float,
    grace_s: float = GRACE_S,
    on_failure: Callable[[], None] = lambda: None,
    name: str = "rank",
    on_leave: Callable[[int, BaseException], None] | None = None,
) -> list[T]:
    """Runs ``fns[r]()`` for every rank r in a thread of its own; returns the results in rank
    order.

    The first rank to raise ends the run: ``on_failure()`` runs (close the clients, so the
    other ranks' calls fail instead of waiting for the dead rank), the others get ``grace_s``
    seconds to end, then ``RankFailed`` is raised from that rank's exception. A run still going
    after ``timeout_s`` raises ``TimeoutError`` naming the ranks still running. Threads are
    daemons: one stuck in pure compute cannot keep the interpreter alive.

    With ``on_leave`` (an elastic run) a rank that raises leaves instead: ``on_leave(rank,
    exc)`` runs, its result is ``RankLeft(rank, exc)`` and the others go on; only when every
    rank left is ``RankFailed`` raised.
    """
    world = len(fns)
    results: list[Any] = [None] * world
    failures: list[tuple[int, BaseException]] = []  # in the order they happened
    finished: set[int] = set()
    changed = threading.Condition()

    def body(rank: int) -> None:
        try:
            results[rank] = fns[rank]()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, whatever it is
            if on_leave is not None:
                on_leave(rank, exc)
                results[rank] = RankLeft(rank, exc)
                return
            with changed:
                failures.append((rank, exc))
        finally:
            with changed:
                finished.add(rank)
                changed.notify_all()

    threads = [
        threading.Thread(target=body, args=(r,), name=f"{name}-{r}", daemon=True)
        for r in range(world)
    ]
    for t in threads:
        t.start()
    try:
        with changed:
            changed.wait_for(lambda: failures or len(finished) == world, timeout=timeout_s)
            ok = not failures and len(finished) == world
    except BaseException:  # Ctrl-C in a notebook: let the ranks go before re-raising
        on_failure()
        raise
    if ok:
        for t in threads:
            t.join()  # they are past their last statement
        all_left(results, world)
        return results
    on_failure()
    with changed:
        changed.wait_for(lambda: len(finished) == world, timeout=grace_s)
        running = sorted(set(range(world)) - finished)
        first = failures[0] if failures else None
    if first is None:
        raise TimeoutError(
            f"ranks {running} of {world} still running after {timeout_s} s "
            f"(raise the run's timeout if the work is just long)"
        )
    rank, error = first
    detail = f" (ranks {running} still running {grace_s} s later)" if running else ""
    raise RankFailed(rank, world, error, detail) from error


class LocalCluster:
    """``world_size`` ranks and ``servers`` shard servers on this machine; ``run(fn)`` calls
    ``fn(config)`` on every rank with that rank's ``ShardingConfiguration``.

    ``servers``: how many in-process servers to start (default: one per rank), or the
    addresses of servers already running (not stopped by the cluster). ``processes``: run
    ranks as spawned processes (``fn`` and its results must then be picklable: a module-level
    function of an importable module) instead of threads. ``run_timeout_s`` bounds each
    ``run``; ``server_options`` are ``ShardServer`` keyword arguments (``max_memory``,
    ``local_calls``, ...). Every other keyword is a ``ShardingConfiguration`` field given to
    every rank (``job``, ``deterministic``, ``param_dtype``, ...); ``run(fn, **fields)`` adds
    or overrides fields for one run. ``timeout_s`` is the configuration's deadline for each
    call to the servers, as everywhere.
    """

    def __init__(
        self,
        world_size: int,
        servers: int | Sequence[str] | None = None,
        *,
        processes: bool = False,
        run_timeout_s: float = RUN_TIMEOUT_S,
        server_options: Mapping[str, Any] | None = None,
        **config_fields: Any,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"LocalCluster.world_size must be an int >= 1, got {world_size!r}")
        if servers is None:
            servers = world_size
        count_ok = isinstance(servers, int) and not isinstance(servers, bool) and servers >= 1
        list_ok = (
            isinstance(servers, Sequence)
            and not isinstance(servers, str)
            and len(servers) > 0
            and all(isinstance(a, str) for a in servers)
        )
        if not (count_ok or list_ok):
            raise ValueError(
                "LocalCluster.servers must be a number of servers to start (>= 1) or a "
                f"non-empty list of 'host:port' addresses, got {servers!r}"
            )
        if server_options and not count_ok:
            raise ValueError(
                "LocalCluster.server_options configure the servers the cluster starts; "
                "with servers given as addresses it starts none"
            )
        if not isinstance(processes, bool):
            raise ValueError(f"LocalCluster.processes must be True or False, got {processes!r}")
        if isinstance(run_timeout_s, bool) or not (
            isinstance(run_timeout_s, (int, float)) and 0 < run_timeout_s < float("inf")
        ):
            raise ValueError(
                f"LocalCluster.run_timeout_s must be a positive finite number of seconds, "
                f"got {run_timeout_s!r}"
            )
        self.world_size = world_size
        self.processes = processes
        self.run_timeout_s = float(run_timeout_s)
        self.config_fields = _checked_fields(config_fields, world_size)
        self._to_start = servers if isinstance(servers, int) else 0
        self._given = [] if isinstance(servers, int) else list(servers)
        self._server_options = dict(server_options or {})
        self._servers: list[Any] = []  # the ShardServers this cluster started
        self._started = False

    @property
    def addresses(self) -> list[str]:
        """``host:port`` of every server, in server order (empty until started)."""
        if not self._started:
            return []
        return self._given or [s.address for s in self._servers]

    def start(self) -> LocalCluster:
        """Starts the in-process servers (``with LocalCluster(...)`` does this)."""
        if not self._started:
            from paramshard.server import ShardServer

            try:
                for _ in range(self._to_start):
                    self._servers.append(ShardServer(**self._server_options).start())
            except BaseException:
                self.close()
                raise
            self._started = True
        return self

    def close(self) -> None:
        """Stops the servers this cluster started; idempotent."""
        servers, self._servers = self._servers, []
        self._started = False
        for s in servers:
            s.stop(0)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "processes" if self.processes else "threads"
        state = ",".join(self.addresses) if self._started else "not started"
        return f"LocalCluster(world_size={self.world_size}, ranks as {kind}, servers: {state})"

    def run(self, fn: Callable[[Any], T], **config_fields: Any) -> list[T]:
        """``[fn(config_0), ..., fn(config_{W-1})]``: each rank's result, in rank order.

        A rank that raises ends the run: the others are stopped and ``RankFailed`` (naming the
        rank, raised from its exception) propagates. In an elastic run (``elastic=True``) it
        leaves instead (docs/elastic.md): its result is ``RankLeft(rank, error)`` and the others
        train on without it. ``config_fields`` add to or override the cluster's
        ``ShardingConfiguration`` fields for this run only.
        """
        if not self._started:
            raise RuntimeError(
                "LocalCluster.run needs running servers: use `with LocalCluster(...) as "
                "cluster:` or call cluster.start() first"
            )
        if not callable(fn):
            raise TypeError(f"LocalCluster.run needs a function fn(config), got {fn!r}")
        run_id = f"local-{uuid.uuid4().hex[:12]}"
        fields = _checked_fields(
            {"job": run_id, **self.config_fields, **config_fields}, self.world_size
        )
        elastic = bool(fields.get("elastic", False))
        if self.processes:
            from paramshard.local_processes import run_in_processes

            return run_in_processes(
                fn, self.world_size, self.addresses, run_id, fields, self.run_timeout_s, elastic
            )
        configs = [
            rank_config(self.addresses, r, self.world_size, run_id, fields)
            for r in range(self.world_size)
        ]

        def close_clients() -> None:
            for config in configs:
                config.client.close()

        def leave(rank: int, error: BaseException) -> None:
            from paramshard.client.membership import leave

            client = configs[rank].client
            leave(client, f"{type(error).__name__}: {error}")  # the others redo its step
            client.close()

        try:
            return run_in_threads(
                [partial(fn, c) for c in configs],
                timeout_s=self.run_timeout_s,
                on_failure=close_clients,
                name=f"paramshard-{run_id}-rank",
                on_leave=leave if elastic else None,
            )
        finally:
            close_clients()


def _checked_fields(fields: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """``fields`` checked now, with ShardingConfiguration's own messages, rather than once per
    rank inside the run (the client is a stand-in that only has a rank and a world size)."""
    from paramshard.strategies.config import ShardingConfiguration

    names = [f.name for f in dataclasses.fields(ShardingConfiguration) if f.name != "client"]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise TypeError(
            f"LocalCluster: {', '.join(map(repr, unknown))} "
            f"{'is not a' if len(unknown) == 1 else 'are not'} ShardingConfiguration "
            f"field{'' if len(unknown) == 1 else 's'}; the fields are {', '.join(names)} "
            f"(the cluster's own options: servers, processes, run_timeout_s, server_options)"
        )
    ShardingConfiguration(SimpleNamespace(rank=0, world_size=world_size), **fields)  # type: ignore[arg-type]
    return dict(fields)
