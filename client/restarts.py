"""A rank's side of ``paramshard launch --max-restarts K``: am I a restart, and may I be one.

The launcher restarts a failed rank on its own, while the other ranks keep running: that is
sound only when the rank kept nothing the others need, i.e. its parameters and optimizer state
live on the servers (ZeRO-1/2, FSDP). A DDP or 3D rank keeps them in its own process, so a
fresh process would train on state the others no longer share. The launcher cannot see which
strategy a rank runs, so each model says where its state is, in a file the launcher reads when
the rank fails (a SIGKILLed process can say nothing then).

Environment, set by the launcher for each rank when K > 0 (torchrun sets
TORCHELASTIC_MAX_RESTARTS and TORCHELASTIC_RESTART_COUNT the same way):

- ``PARAMSHARD_MAX_RESTARTS``: K, the restarts the launcher may make in all;
- ``PARAMSHARD_RESTART_COUNT``: how many times this rank was restarted (0: its first process);
- ``PARAMSHARD_RESTART_FILE``: where this rank's models declare themselves, one line each,
  ``<strategy> servers`` or ``<strategy> trainers``, and where a rank that found its job lost
  says so (``job-lost <job>``: nothing holds its state, so a restart would train it anew), as
  does a rank whose wait the servers refused because the ranks it waited for ended for good
  (``peers-ended``: uneven inputs; a restart would wait for them too). A rank whose own code
  raised in ``train_with_recovery`` says so before it stops the others (``failed <why>``), so
  the launcher names it, not a rank that its notice stopped first; a rank that such a notice
  stopped says what the notice said, with its restart count (``stopped <count> <notice>``), so
  a launcher that does not run the rank that raised (another host's) names it through that,
  and does not restart it (the run cannot go on). A rank the launcher may restart stops
  nobody; it says why it raised (``error <count> <why>``), for the launcher's message should
  it not be restarted. The launcher sets this one without ``--max-restarts`` too.
  The file outlives the process, so a restart that fails again before building its model is
  judged by the first one's lines.

Torch-free: the launcher reads the file, the strategies write it.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

__all__ = [
    "ELASTIC_ENV",
    "LAUNCH_ENV",
    "MAX_RESTARTS_ENV",
    "RESTART_COUNT_ENV",
    "RESTART_FILE_ENV",
    "Declaration",
    "declare",
    "declare_lost",
    "declare_failed",
    "declare_peers_ended",
    "declared_stop",
    "ends_for_good",
    "group_restarted",
    "group_restarts_left",
    "max_restarts",
    "one_line",
    "read_declaration",
    "launch_id",
    "launched",
    "restart_count",
    "restarted",
    "starts_anew",
]

ELASTIC_ENV = "PARAMSHARD_ELASTIC"
"""Set to 1 by ``paramshard launch --elastic``: ``ShardingConfiguration.from_env`` is elastic
(client/membership.py), and a rank that ends may be replaced."""
MAX_RESTARTS_ENV = "PARAMSHARD_MAX_RESTARTS"
RESTART_COUNT_ENV = "PARAMSHARD_RESTART_COUNT"
RESTART_FILE_ENV = "PARAMSHARD_RESTART_FILE"
LAUNCH_ENV = "PARAMSHARD_LAUNCH_ID"
"""Set by ``paramshard launch --max-restarts``: a random id of the launcher, the same for a
rank's restarts. Its leases carry it (``LeaseRequest.launch``), so that a restart meets the
final notice of its own job's run only, not that of an earlier job under the run id."""
_TORCHRUN_COUNTS = ("TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT")
ON_SERVERS, ON_TRAINERS = "servers", "trainers"
LOST = "job-lost"
PEERS_ENDED = "peers-ended"
FAILED = "failed"
STOPPED = "stopped"
ERROR = "error"

log = logging.getLogger(__name__)


def _env_count(name: str) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise ValueError(f"environment variable {name} must be an integer >= 0, got {raw!r}")
    return int(raw)


def max_restarts() -> int:
    """K of ``paramshard launch --max-restarts K`` (0 when ranks are never restarted)."""
    return _env_count(MAX_RESTARTS_ENV)


def group_restarts_left() -> int:
    """How many more times torchrun (``--max-restarts K``, from its ``TORCHELASTIC_MAX_RESTARTS``
    and ``TORCHELASTIC_RESTART_COUNT``) restarts this process's worker group should a worker
    fail. It restarts every worker it runs then, and the other nodes' agents restart theirs on
    the new rendezvous: the job's ranks all start again, and a ZeRO-1/2 or FSDP job resumes at
    the servers' step. 0 outside torchrun, and under ``paramshard launch``, which restarts a
    failed rank alone (``max_restarts``); a value that is not a count reads as 0."""
    if launched():
        return 0
    most, done = (os.environ.get(name, "").strip() for name in _TORCHRUN_COUNTS)
    return max(0, int(most) - int(done)) if most.isdigit() and done.isdigit() else 0


def group_restarted() -> bool:
    """Whether torchrun restarted this process's worker group (its ``TORCHELASTIC_RESTART_COUNT``
    above 0): every rank of the job is a new process of its rank, resuming at the servers'
    step, and may find them applying a step their first processes pushed."""
    done = os.environ.get(_TORCHRUN_COUNTS[1], "").strip()
    return not launched() and done.isdigit() and int(done) > 0


def ends_for_good() -> bool:
    """Whether this process's rank ends for good when it releases its lease now: at the
    process's exit with no uncaught exception (protos/closing.py), where nothing starts it
    again (no ``--max-restarts``; an elastic rank may be replaced). A ``sys.exit(1)`` counts
    as such an exit: no exit hook can read its code."""
    from paramshard.protos import closing

    return closing.ending_normally() and not max_restarts() and not os.environ.get(ELASTIC_ENV)


def launched() -> bool:
    """Whether ``paramshard launch`` started this rank (it gave it a declaration file): the
    launcher then sees its exit code, and tells the servers how the rank ended itself."""
    return bool(os.environ.get(RESTART_FILE_ENV))


def launch_id() -> str:
    """The launcher's id (``LAUNCH_ENV``), at most 64 characters; "" when none gave one."""
    return os.environ.get(LAUNCH_ENV, "")[:64]


def restart_count() -> int:
    """How many times the launcher restarted this rank (0: this is its first process)."""
    return _env_count(RESTART_COUNT_ENV)


def restarted(took_over: bool) -> bool:
    """Whether this process restarts its rank: its launcher says so (``restart_count``), or a
    server saw an earlier process of the rank in this run (``took_over``: its client's
    ``RunState.took_over``), as when a node's launch command is run again by hand."""
    return restart_count() > 0 or took_over


def starts_anew(job: str, rank: int) -> None:
    """Says that a restarted rank found ``job`` holding no values on any server, so the job
    starts at step 0. A first process says nothing (a new job starts there); a restart
    finding nothing means the servers came back empty since (or the job never trained a
    step): the steps trained before are trained again, unless a snapshot is restored."""
    if restart_count() > 0:
        log.warning(
            "rank %d was restarted (%s=%d) and finds job '%s' holding no values on any server"
            " (they were restarted empty since it last ran, or the job never trained a step):"
            " the job starts at step 0; model.load_checkpoint('latest') restores its newest"
            " snapshot, if any",
            rank,
            RESTART_COUNT_ENV,
            restart_count(),
            job,
        )


def declare(strategy: str, state_on_servers: bool, rank: int) -> None:
    """Called by every sharded model when it is built: records where its state lives for the
    launcher, and refuses to build a model that keeps state on the trainer in a restarted
    rank (its fresh parameters would differ from the others' trained ones)."""
    _say(f"{strategy} {ON_SERVERS if state_on_servers else ON_TRAINERS}")
    if not state_on_servers and restart_count() > 0:
        raise RuntimeError(
            f"rank {rank} was restarted ({RESTART_COUNT_ENV}={restart_count()}), but a"
            f" {strategy} model keeps its parameters and optimizer state in the trainer"
            " process, so this one would train on state the other ranks no longer share."
            " paramshard launch --max-restarts can restart ZeRO-1, ZeRO-2 and FSDP ranks only;"
            f" run {strategy} without it (a failed rank then stops the job)"
        )
    if not state_on_servers and max_restarts() > 0 and rank == 0:
        warnings.warn(
            f"paramshard launch --max-restarts does not apply to {strategy}: its ranks keep"
            " state in the trainer process, so a failed rank stops the job",
            stacklevel=4,  # the user's line that built the model
        )


def one_line(exc: BaseException) -> str:
    """``ValueError: bad batch 3``: the type and the first line of the message that has text,
    at most 400 characters, whatever the exception holds (a message whose ``str()`` raises, a
    file name that is not UTF-8): it travels in a notice and a file."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - an exception's own __str__ may fail
        text = "(its message could not be read)"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    why = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return why.encode("utf-8", "backslashreplace").decode("utf-8")[:400]


def declare_lost(job: str) -> None:
    """Records for the launcher that this rank found ``job`` lost (``JobLost``: no server,
    replica or snapshot holds its state): a new process would start it anew at step 0 and
    call that continuous, so the launcher does not restart the rank for it."""
    _say_stop(f"{LOST} {job}")


def declare_peers_ended() -> None:
    """Records for the launcher that a wait of this rank's failed because the ranks it waited
    for ended for good (protos/ended_ranks.py): a new process would make the same collectives
    and wait for them too, so the launcher does not restart the rank for it."""
    _say_stop(PEERS_ENDED)


def declare_failed(why: str) -> None:
    """Records for the launcher that this rank's own code raised (``why``: one line) and that
    it stops the others: their failures follow from it (strategies/recovery_rounds.py)."""
    _say_stop(f"{FAILED} {why}")


def declare_stopped(notice: str) -> None:
    """Records for the launcher that this rank stops on the run's final notice (``notice``:
    what it said, naming the rank that posted it and why), not on its own error."""
    _say_stop(f"{STOPPED} {restart_count()} {notice}")


def declare_error(why: str) -> None:
    """Records for the launcher why this rank's own code raised, when it stops nobody (the
    launcher may restart it): the launcher names it, should it not restart the rank."""
    _say_stop(f"{ERROR} {restart_count()} {why}")


_stop_said = False  # this process declared why it stops (``declared_stop``)


def declared_stop() -> bool:
    """Whether this process declared why it stops (its error, a notice, a lost job)."""
    return _stop_said


def _say_stop(line: str) -> None:
    global _stop_said
    _stop_said = True
    _say(line)


def _say(line: str) -> None:
    """Appends ``line`` to this rank's declaration file, if the launcher gave it one; what is
    not UTF-8 (a file name in an error) is written escaped. A file that cannot be written
    (a full disk) is logged: the launcher then knows less, and the rank goes on."""
    path = os.environ.get(RESTART_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8", errors="backslashreplace") as f:
            f.write(f"{' '.join(line.split())}\n")
    except OSError as exc:
        log.warning("could not tell the launcher %r: %s", line.split(" ", 1)[0], exc)


@dataclass(frozen=True)
class Declaration:
    """What a rank's models said about themselves (``read_declaration``)."""

    strategies: tuple[str, ...]  # in the order the models were built
    on_trainers: tuple[str, ...]  # those keeping state in the trainer process
    lost: tuple[str, ...] = ()  # jobs the rank found lost (``declare_lost``)
    peers_ended: bool = False  # it waited for ranks that ended (``declare_peers_ended``)
    failed: str = ""  # why its own code raised, when it stopped the others (``declare_failed``)
    stops: tuple[tuple[int, str], ...] = ()  # (restart count, notice) (``declare_stopped``)
    errors: tuple[tuple[int, str], ...] = ()  # (restart count, why) (``declare_error``)

    def error(self, attempt: int) -> str:
        """Why the rank's process of restart count ``attempt`` raised, if it said."""
        return next((why for n, why in reversed(self.errors) if n == attempt), "")

    def stopped(self, attempt: int) -> str:
        """The final notice the rank's process of restart count ``attempt`` stopped on."""
        return next((notice for n, notice in reversed(self.stops) if n == attempt), "")

    @property
    def restartable(self) -> bool:
        """Some model was built and every one of them keeps its state on the servers (a 3D
        model's parts are ZeRO models, but the pipeline and tensor parts are not: it says
        ``trainers`` itself)."""
        return bool(self.strategies) and not self.on_trainers


def read_declaration(path: str) -> Declaration:
    """The lines ``declare`` wrote to ``path`` (none if the rank built no model yet)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:  # written by the rank
            rows = [line.split() for line in f if line.strip()]
    except FileNotFoundError:
        rows = []
    lost = tuple(" ".join(r[1:]) for r in rows if r[0] == LOST)
    peers_ended = any(r[0] == PEERS_ENDED for r in rows)
    failed = next((" ".join(r[1:]) or "?" for r in rows if r[0] == FAILED), "")
    stops, errors = (
        tuple(
            (int(r[1]), " ".join(r[2:]) or "?")
            for r in rows
            if r[0] == kind and len(r) > 1 and r[1].isascii() and r[1].isdigit()
        )
        for kind in (STOPPED, ERROR)
    )
    rows = [r for r in rows if r[0] not in (LOST, PEERS_ENDED, FAILED, STOPPED, ERROR)]
    strategies = tuple(r[0] for r in rows)
    on_trainers = tuple(r[0] for r in rows if len(r) != 2 or r[1] != ON_SERVERS)
    return Declaration(strategies, on_trainers, lost, peers_ended, failed, stops, errors)
