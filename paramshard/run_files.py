"""Run files: how the job tools find a job that ``paramshard launch`` started.

While it runs, ``paramshard launch`` keeps one file per run in the per-user run directory,
``<run dir>/<run id>.json`` (the directory mode 0700, the file 0600): the servers' addresses,
the run id, the job name when the launcher knows it (a ``--config`` file's ``job``), the token
file and TLS files the ranks use, the launcher's pid and host, and where the local servers
write snapshots. It removes the file when it exits (normal end, failure, SIGINT, SIGTERM,
SIGHUP, SIGQUIT); a launcher killed outright leaves it behind, and readers drop such a file
once its pid is gone.

``paramshard status``, ``inspect``, ``get``, ``snapshot``, ``snapshots``, ``restore`` and
``export`` read it when neither ``--servers`` nor ``PARAMSHARD_SERVERS`` says where the servers
are (``commands.cluster_spec``): one live run is used as it is, several are listed and
``--run RUN_ID`` picks one.

The run directory is ``$PARAMSHARD_RUN_DIR``, else ``$XDG_CACHE_HOME/paramshard/runs``, else
``~/.cache/paramshard/runs``. It is on disk, not in ``$XDG_RUNTIME_DIR`` (memory, emptied at
logout), because launch's local servers keep their snapshots under it by default
(``<run dir>/<run id>/snapshots``), and a snapshot must outlive the launcher.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "RUN_DIR_ENV", "RunFile", "RunLookupError", "announce_run", "drop_unused_snapshot_dir",
    "find", "live_runs", "local_snapshot_dir", "run_dir",
]  # fmt: skip

RUN_DIR_ENV = "PARAMSHARD_RUN_DIR"
_TLS_ENV = {
    "tls_ca": "PARAMSHARD_TLS_CA",
    "tls_cert": "PARAMSHARD_TLS_CERT",
    "tls_key": "PARAMSHARD_TLS_KEY",
    "tls_server_name": "PARAMSHARD_TLS_SERVER_NAME",
}


class RunLookupError(Exception):
    """No run file answers the question: the message says what there is."""


def run_dir() -> Path:
    """The per-user run directory (module docstring); not created here."""
    if os.environ.get(RUN_DIR_ENV, "").strip():
        return Path(os.environ[RUN_DIR_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(cache).expanduser() if cache else Path.home() / ".cache"
    return base / "paramshard" / "runs"


def _private_dir(path: Path) -> Path:
    """``path``, created with mode 0700 (its missing parents as the umask says), refused when
    another user owns it, closed to others when they may write into it: run files name token
    files, and snapshots hold the model."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"run directory {path} belongs to another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.chmod(path, 0o700)  # ours: made by hand or by an older version; close it
    return path


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (Linux clock ticks since boot), None where unknown: with
    the pid, it tells a live launcher from a later process that got its pid."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class RunFile:
    """What a launcher says about its run."""

    run_id: str
    servers: list[str]
    jobs: list[str] = field(default_factory=list)
    """Job names the launcher knows of (a --config file's ``job``); ``paramshard status`` lists
    every job the servers hold."""
    token_file: str | None = None
    """The --token-file the ranks use (absolute), read again by each tool."""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    snapshot_dir: str | None = None
    """Where launch's local servers write snapshots (None: servers of --servers)."""
    pid: int = field(default_factory=os.getpid)
    started_ticks: int | None = None
    host: str = field(default_factory=socket.gethostname)
    started: float = field(default_factory=time.time)
    path: Path | None = field(default=None, compare=False)

    @classmethod
    def for_launch(cls, **fields: Any) -> RunFile:
        """This launcher's run: the TLS files the ranks inherit (PARAMSHARD_TLS_*, absolute)."""
        tls = {
            name: os.path.abspath(os.environ[var]) if name != "tls_server_name" else os.environ[var]
            for name, var in _TLS_ENV.items()
            if os.environ.get(var)
        }
        if fields.get("token_file"):
            fields["token_file"] = os.path.abspath(fields["token_file"])
        return cls(started_ticks=_start_ticks(os.getpid()), **tls, **fields)

    def write(self) -> Path | None:
        """Writes it as ``<run dir>/<run id>.json`` (0600, replacing the file whole); returns
        its path, or None when that file is another live launcher's (a second launch under
        the run id, or another node's launcher on this host): it stays. OSError
        (PermissionError) when the run directory cannot be made or is another user's."""
        folder = _private_dir(run_dir())
        path = folder / f"{_file_name(self.run_id)}.json"
        other = _read(path)
        if other is not None and not self._is(other) and other.alive():
            return None
        tmp = folder / f".{path.name}.{os.getpid()}.tmp"
        record = {k: v for k, v in asdict(self).items() if k != "path"}
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
        self.path = path
        return path

    def remove(self) -> None:
        """Removes the file this launcher wrote (nothing if it is gone or was never written),
        and the default snapshot folder if no snapshot went into it."""
        if self.path is None:
            return
        on_disk = _read(self.path)
        if on_disk is not None and not self._is(on_disk):
            return  # replaced since by a later launcher of the run id, once this one was dead
        self.path.unlink(missing_ok=True)
        drop_unused_snapshot_dir(self.run_id, self.path.parent)

    def _is(self, other: RunFile) -> bool:
        """Whether ``other`` (read from a file) is this launcher's run."""
        return (other.pid, other.host, other.started) == (self.pid, self.host, self.started)

    def alive(self) -> bool:
        """Whether its launcher still runs. A run file of another host cannot be checked and
        counts as alive (a home directory shared between hosts)."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # a process of another user has that pid now: not our launcher
        ticks = _start_ticks(self.pid)
        return self.started_ticks is None or ticks is None or ticks == self.started_ticks

    def env(self) -> dict[str, str]:
        """The PARAMSHARD_* settings a client of this run uses (ClusterSpec.from_env reads
        them): servers, TLS files; the token is read from ``token_file`` by the caller."""
        out = {"PARAMSHARD_SERVERS": ",".join(self.servers)}
        for name, var in _TLS_ENV.items():
            if getattr(self, name):
                out[var] = getattr(self, name)
        return out

    def describe(self) -> str:
        age = time.time() - self.started
        jobs = f", jobs {', '.join(self.jobs)}" if self.jobs else ""
        return (
            f"{self.run_id} (servers {','.join(self.servers)}{jobs}; launcher pid {self.pid} on"
            f" {self.host}, started {age:.0f} s ago)"
        )


def _file_name(run_id: str) -> str:
    """A run id as a file name: path separators and leading dots cannot escape the folder."""
    return run_id.replace("/", "_").replace(os.sep, "_").lstrip(".") or "run"


def _read(path: Path) -> RunFile | None:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        run = RunFile(**record)
    except (OSError, ValueError, TypeError):
        return None  # being written, or not ours: not a run
    if not isinstance(run.servers, list) or not run.servers:
        return None
    run.path = path
    return run


def live_runs() -> list[RunFile]:
    """The runs whose launcher still runs, oldest first; the files of dead launchers (killed
    outright) are removed on the way."""
    folder = run_dir()
    if not folder.is_dir():
        return []
    runs = []
    for path in sorted(folder.glob("*.json")):
        run = _read(path)
        if run is None:
            continue
        if run.alive():
            runs.append(run)
        else:
            run.remove()
    return sorted(runs, key=lambda r: r.started)


def find(run_id: str | None = None) -> RunFile:
    """The live run ``run_id``, or the only live run when None; RunLookupError says why not
    (none, or several: each listed)."""
    runs = live_runs()
    if run_id is not None:
        for run in runs:
            if run.run_id == run_id:
                return run
        known = "; ".join(r.describe() for r in runs) or "none"
        raise RunLookupError(f"no live run '{run_id}' in {run_dir()} (live runs: {known})")
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise RunLookupError(f"no run started by paramshard launch is alive ({run_dir()} has none)")
    listed = "\n  ".join(r.describe() for r in runs)
    raise RunLookupError(
        f"{len(runs)} runs started by paramshard launch are alive; pick one with --run RUN_ID"
        f" (or give --servers):\n  {listed}"
    )


def drop_unused_snapshot_dir(run_id: str, folder: Path | None = None) -> None:
    """Removes run ``run_id``'s default snapshot folder (``local_snapshot_dir``) when no
    snapshot went into it: snapshots outlive the run, empty folders need not."""
    own = (folder or run_dir()) / _file_name(run_id)
    for path in (own / "snapshots", own):
        try:
            path.rmdir()  # only when empty
        except OSError:
            return


# ------------------------------------------------------------------------ the launcher's side
def local_snapshot_dir(chosen: str | None, run_id: str) -> str | None:
    """Where launch's local servers write snapshots: ``--snapshot-dir`` (``chosen``; OSError
    when it cannot be made), else ``<run dir>/<run id>/snapshots`` (0700), or None with a
    warning when that cannot be made (a read-only home): the servers then have none."""
    if chosen:
        path = Path(chosen).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        return str(path)
    try:
        folder = _private_dir(_private_dir(run_dir()) / _file_name(run_id)) / "snapshots"
        folder.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        _warn(f"no snapshot directory for the local servers ({exc}); give --snapshot-dir")
        return None
    return str(folder)


def announce_run(
    run_id: str,
    servers: list[str],
    token_file: str | None,
    config: str | None,
    snapshot_dir: str | None,
) -> RunFile:
    """Writes this launcher's run file (``RunFile.remove`` takes it away at exit); the job name
    comes from the ``--config`` file when it names one."""
    jobs = []
    if config:
        from paramshard.protos.config_file import read_config_file

        job = read_config_file(config).get("job")  # launch checked that the file reads
        if isinstance(job, str):
            jobs.append(job)
    run = RunFile.for_launch(
        run_id=run_id,
        servers=list(servers),
        jobs=jobs,
        token_file=token_file,
        snapshot_dir=snapshot_dir,
    )
    try:
        if run.write() is None:
            _warn(
                f"run '{run_id}' has a run file of another live launcher: it stays, and the"
                " job tools find that launcher's servers (two jobs under one run id are"
                " refused by the servers; another node of the run is not)"
            )
    except OSError as exc:  # the run goes on; only the tools will not find it by themselves
        _warn(f"no run file ({exc}): the job tools need --servers to find this run")
    return run


def _warn(message: str) -> None:
    print(f"paramshard launch: warning: {message}", file=sys.stderr, flush=True)
