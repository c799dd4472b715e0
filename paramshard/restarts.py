"""Supervising the ranks of ``paramshard launch``: restart a failed one, or stop them all.

With ``--max-restarts K`` a rank that fails is started again, alone, up to K times in all over
the job (torchrun's ``--max-restarts`` restarts the whole worker group instead; here the
servers keep the state, so the ranks that still run keep running and wait for the new one at
their next call to the servers). The new process gets the same environment plus
``PARAMSHARD_RESTART_COUNT`` (client/restarts.py); a ZeRO-1/2 or FSDP model built in it adopts
the servers' step (``model.step_count``), and the script resumes its data there.

A rank is restarted only if its models declared that their state is on the servers: a DDP or
3D rank keeps parameters and optimizer state in its own process, so its failure stops the job
at once, as without ``--max-restarts``. So does a rank that failed before building a model,
one that found its job lost (``JobLost``: a restart would train it anew from step 0), one
whose wait failed because the ranks it waited for exited 0 (uneven inputs: a restart would wait
for them too; the launcher tells the servers that a rank exited 0, paramshard/finished_ranks.py),
and any failure once the K restarts are used up.

Before a rank is started again (or, with ``--elastic``, once it left the job), what its
failed process left in its process group (a data loader's workers, a shell's children) gets
SIGTERM, ``--grace`` seconds, then SIGKILL, and the process is reaped, as when the job ends
(paramshard/processes.py); so is a local server's before it is started again.

Every rank's other calls wait for the restarted one within their deadline (``timeout_s``,
120 s by default, and the servers' ``--max-wait-s``): a restart must get back to the servers
within it.

With ``--max-server-restarts K`` a local server that exits while the ranks run is started
again, empty, at its address (K times in all over the job). Ranks in ``train_with_recovery``
(strategies/recovery.py) wait for it there and restore its state from the neighbour's replica
or the newest snapshot; a rank that does not recover fails at its next call to it, and its
failure is handled as any other. Without it, or once the K are used, a server's exit stops the
job.
"""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from paramshard.client import restarts as contract
from paramshard.commands import EXIT_FAILURE, CommandError
from paramshard.elastic import Departures
from paramshard.processes import Child, exit_code, say, stop, watch

__all__ = ["RankRestarts", "ServerRestarts", "supervise"]


@dataclass
class RankRestarts:
    """The restart budget of one launcher and what each of its ranks declared."""

    max_restarts: int  # --max-restarts: restarts allowed in all, over every rank
    directory: str = ""  # holds rank-R files the ranks declare themselves in ("": none)
    counts: dict[int, int] = field(default_factory=dict)  # rank -> restarts so far
    launch: str = field(default_factory=lambda: secrets.token_hex(8))  # its ranks' LAUNCH_ENV

    @classmethod
    def create(cls, max_restarts: int) -> RankRestarts:
        return cls(max_restarts, tempfile.mkdtemp(prefix="paramshard-restarts-"))

    @property
    def used(self) -> int:
        return sum(self.counts.values())

    def env(self, rank: int) -> dict[str, str]:
        """What rank ``rank``'s next process is told: where it declares itself, and, with
        --max-restarts, the restarts and which launcher makes them."""
        env = {contract.RESTART_FILE_ENV: self._file(rank)} if self.directory else {}
        if self.max_restarts:
            env[contract.MAX_RESTARTS_ENV] = str(self.max_restarts)
            env[contract.RESTART_COUNT_ENV] = str(self.attempt(rank))
            env[contract.LAUNCH_ENV] = self.launch
        return env

    def _file(self, rank: int) -> str:
        return os.path.join(self.directory, f"rank-{rank}")

    def declared_failure(self, child: Child) -> str:
        """``: <why>`` when rank ``child`` (its process that just ended) declared that its own
        code raised; ``: on the run's notice: <notice>`` when it declared that it stopped on
        another's; else the last error its output showed (``Child.last_error``: it failed
        before it could declare, a config file's error say), or ""."""
        rank = child.rank
        said, attempt = contract.read_declaration(self._file(rank)), self.attempt(rank)
        if own := said.failed or said.error(attempt):
            return f": {own}"
        notice = said.stopped(attempt)
        if notice:
            return f": on the run's notice: {notice}"
        return f": {child.last_error}" if child.last_error else ""

    def raised(self, rank: int) -> bool:
        """Whether rank ``rank`` declared that its own code raised and stopped the others
        (client/restarts.py ``declare_failed``)."""
        return bool(contract.read_declaration(self._file(rank)).failed)

    def another_raised(self, running: set[Child], but: int) -> bool:
        """Whether a running rank other than ``but`` declared that its own code raised and
        stopped the others: ``but`` failed on its notice."""
        return any(c.rank != but and self.raised(c.rank) for c in running)

    def attempt(self, rank: int) -> int:
        """How many times ``rank`` was restarted: 0 for its first process (torchrun's attempt
        number, TORCHELASTIC_RESTART_COUNT; ``--log-dir`` files it under ``attempt_<n>``)."""
        return self.counts.get(rank, 0)

    def refusal(self, rank: int) -> str | None:
        """None if rank ``rank``, which just failed, may be restarted; else why not."""
        if not self.max_restarts:
            return ""
        said = contract.read_declaration(self._file(rank))
        if said.lost:
            return (
                f"not restarted: it found job '{said.lost[-1]}' lost (JobLost: no server,"
                " replica or snapshot holds its state); a new process would train it anew"
                " from step 0"
            )
        if said.failed:
            return (
                "not restarted: its own error ended the run on every rank (a final notice);"
                " a new process would meet it too"
            )
        if said.stopped(self.attempt(rank)):
            return (
                "not restarted: it stopped on the run's final notice (the run cannot go on);"
                " a new process would stop on it too"
            )
        if said.peers_ended:
            return (
                "not restarted: it waited for ranks that ended for good (uneven inputs?); a"
                " new process would make the same collectives and wait for them too"
            )
        if self.used >= self.max_restarts:
            return f"not restarted: --max-restarts {self.max_restarts} used up"
        if not said.strategies:
            return (
                "not restarted: it failed before building a sharded model, so nothing says"
                " its state is on the servers"
            )
        if said.on_trainers:
            return (
                f"not restarted: its {said.on_trainers[0]} model kept parameters and"
                " optimizer state in the trainer process, which died with it; --max-restarts"
                " restarts ZeRO-1, ZeRO-2 and FSDP ranks only"
            )
        return None

    def count(self, rank: int) -> int:
        """Records one more restart of ``rank``; returns how many it has had."""
        self.counts[rank] = self.counts.get(rank, 0) + 1
        return self.counts[rank]

    def close(self) -> None:
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class ServerRestarts:
    """--max-server-restarts: the local servers the launcher may start again, and how."""

    max_restarts: int
    start_again: Callable[[int], Child] | None = None  # server index -> its new process
    used: int = 0

    def refusal(self) -> str | None:
        """None if a local server that exited may be started again; else why not ("" when
        restarts were not asked for)."""
        if not self.max_restarts or self.start_again is None:
            return ""
        if self.used >= self.max_restarts:
            return f"--max-server-restarts {self.max_restarts} used up"
        return None

    def start(self, servers: list[Child], child: Child) -> Child:
        """Starts the server ``child`` was at its address; it takes ``child``'s place in
        ``servers`` (which the launcher stops at the end). A failed start counts too."""
        assert self.start_again is not None
        index = servers.index(child)
        self.used += 1
        servers[index] = self.start_again(index)
        return servers[index]


def supervise(
    ranks: list[Child],
    servers: list[Child],
    events: queue.SimpleQueue,
    received: list[int],
    grace: float,
    restarts: RankRestarts,
    start_rank: Callable[[int], Child],
    departures: Departures | None = None,
    server_restarts: ServerRestarts | None = None,
    finished: Callable[[int], None] | None = None,
    given_up: Callable[[int, str], None] | None = None,
) -> int:
    """Waits for the ranks; a failed rank is restarted when ``restarts`` allows it (the new
    process is appended to ``ranks``), a local server that exited when ``server_restarts``
    allows it (the new process takes its place in ``servers``), else the first failure (a
    rank, a local server, a signal) stops them all. ``start_rank(rank)`` starts rank
    ``rank``'s process. ``departures`` (``--elastic``): a rank that fails for good leaves, the
    others go on. ``finished(rank)``: a rank exited 0 (nothing starts it again).
    ``given_up(rank, why)``: a rank that failed and is not restarted ends the run."""
    server_restarts = server_restarts or ServerRestarts(0)
    running = set(ranks)
    waiting: _Stopped | None = None  # a rank that failed on another's notice
    while running:
        try:
            kind, child, value = events.get(timeout=waiting.left() if waiting else None)
        except queue.Empty:  # the rank that raised did not exit in time: blame the first
            said = restarts.declared_failure(waiting.child)
            return _stop_all(waiting.child, waiting.code, said, running, None, grace, received)
        if kind == "signal":
            name = signal.Signals(value).name
            say(f"{name}: stopping the ranks (--grace {grace:g} s; again to kill them now)")
            stop(list(running), value, grace, received)
            return 128 + value
        if child in servers:
            exited = f"{child.name} exited (exit code {child.proc.returncode})"
            why = server_restarts.refusal()
            if why is None:
                stop([child], signal.SIGTERM, grace, received)  # what it left; reaps it
                try:
                    new = server_restarts.start(servers, child)
                except CommandError as exc:
                    say(f"{exited}; starting it again failed: {exc}; stopping the ranks")
                    stop(list(running), signal.SIGTERM, grace, received)
                    return EXIT_FAILURE
                watch(new, events)
                say(
                    f"{exited}; started it again, empty, at its address ({server_restarts.used}"
                    f" of --max-server-restarts {server_restarts.max_restarts} used): ranks in"
                    " train_with_recovery restore its state, others fail at their next call"
                )
                continue
            why = f" ({why})" if why else ""
            say(f"{exited}{why}; stopping the ranks")
            stop(list(running), signal.SIGTERM, grace, received)
            return EXIT_FAILURE
        running.discard(child)
        if value == 0:
            if departures is not None:
                departures.finished += 1
            elif finished is not None:
                finished(child.rank)
            continue
        code = exit_code(value)
        why = restarts.refusal(child.rank)
        if why is None or departures is not None:
            # the job goes on without this process: stop what it left in its group (a data
            # loader's workers) and reap it now, not when the job ends
            stop([child], signal.SIGTERM, grace, received)
        if why is None:
            said = restarts.declared_failure(child)  # before the count moves on
            n = restarts.count(child.rank)
            say(
                f"{child.name} failed with exit code {code}{said}; restarting it (its restart {n};"
                f" {restarts.used} of --max-restarts {restarts.max_restarts} used)"
            )
            new = start_rank(child.rank)
            ranks.append(new)
            running.add(new)
            continue
        why = f" ({why})" if why else ""
        if departures is not None:
            why = restarts.declared_failure(child) + why  # what it raised, as for a restart
            departures.leave(child.rank, code)
            short = departures.too_few(len(running))
            if not short:
                say(
                    f"{child.name} failed with exit code {code}{why}; it left the elastic job,"
                    f" {len(running)} rank(s) train on"
                )
                continue
            say(f"{child.name} failed with exit code {code}{why}; {short}: stopping the job")
            stop(list(running), signal.SIGTERM, grace, received)
            return code
        if not restarts.raised(child.rank) and restarts.another_raised(running, child.rank):
            # it failed on that running rank's notice: name that one as it exits
            waiting = waiting or _Stopped(child, code, time.monotonic() + NOTICE_GRACE_S)
            continue
        said = restarts.declared_failure(child)
        if given_up is not None:  # not restarted: other hosts' ranks must not wait for it
            given_up(child.rank, f"failed with exit code {code}{said}{why}")
        return _stop_all(child, code, f"{said}{why}", running, waiting, grace, received)
    if waiting is not None:  # the rank that raised exited 0 all the same
        said = restarts.declared_failure(waiting.child)
        return _stop_all(waiting.child, waiting.code, said, running, None, grace, received)
    return departures.exit_code() if departures is not None else 0


NOTICE_GRACE_S = 10.0
"""How long the launcher waits for a rank whose own code raised, once another rank failed on
its notice (strategies/recovery_rounds.py): the one that raised is named, with its exit code.
Its notice stops the others within a second, while it may still be exiting."""


@dataclass
class _Stopped:
    """A rank that failed on another rank's notice, and until when to wait for that one."""

    child: Child
    code: int
    until: float

    def left(self) -> float:
        return max(0.0, self.until - time.monotonic())


def _stop_all(
    child: Child,
    code: int,
    why: str,
    running: set[Child],
    stopped: _Stopped | None,
    grace: float,
    received: list[int],
) -> int:
    """``child``'s failure ends the job: said, the other ranks stopped; returns ``code``.
    ``stopped``: a rank that had failed on its notice."""
    plural = "" if len(running) == 1 else "s"
    others = f"; stopping {len(running)} other rank{plural}" if running else ""
    if stopped is not None:
        why += f"; {stopped.child.name} stopped on its notice (exit code {stopped.code})"
    say(f"{child.name} failed with exit code {code}{why}{others}")
    stop(list(running), signal.SIGTERM, grace, received)
    return code
