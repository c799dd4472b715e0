"""The little framework of the ``paramshard`` command: ``@command``, argument types, errors, and
the helpers client commands share (the cluster from the environment, tables, sizes).

Every subcommand is one function registered with ``@command``; its arguments are declared next to
it, the docstring's first paragraph is its line in ``paramshard --help`` (``summary``: a whole
sentence, however it wraps) and the whole docstring its description::

    @command(arg("address", help="host:port of the server"))
    def ping(args: argparse.Namespace) -> int:
        \"\"\"One line for the command list.\"\"\"
        ...
        return 0

A command returns its exit code, or raises ``CommandError`` to print one line (no traceback) and
exit with the error's code. Commands import what they need inside the function, so ``health``
never loads NumPy and ``serve`` never loads the client.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from inspect import cleandoc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paramshard.client import ClusterSpec

__all__ = [
    "command",
    "arg",
    "CommandError",
    "COMMANDS",
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "RUN",
    "cluster_spec",
    "paramshard_argv",
    "bare_token",
    "read_token",
    "summary",
]

EXIT_FAILURE = 1
EXIT_USAGE = 2  # argparse's code for bad arguments; also ours for settings that cannot work


class CommandError(Exception):
    """A failure reported as ``paramshard CMD: error: MESSAGE`` with exit code ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Arg:
    """One ``ArgumentParser.add_argument(*flags, **options)`` call."""

    flags: tuple[str, ...]
    options: dict[str, Any]


def arg(*flags: str, **options: Any) -> Arg:
    """Declares an argument of a command (same parameters as ``add_argument``)."""
    return Arg(flags, options)


@dataclass(frozen=True)
class Command:
    name: str
    run: Callable[[argparse.Namespace], int]
    args: tuple[Arg, ...]
    usage_exit: int = EXIT_USAGE
    """The exit code of a command line its parser cannot read."""


COMMANDS: dict[str, Command] = {}
"""Subcommands in registration order (the order ``paramshard --help`` lists them)."""


def command(
    *args: Arg, name: str | None = None, usage_exit: int = EXIT_USAGE
) -> Callable[[Callable], Callable]:
    """Registers the decorated function as subcommand ``name`` (default: the function's name),
    whose unreadable command lines exit ``usage_exit`` (argparse's 2 unless told)."""

    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        cmd = name or fn.__name__.replace("_", "-")
        COMMANDS[cmd] = Command(cmd, fn, args, usage_exit)
        return fn

    return register


def summary(doc: str) -> str:
    """A command's line in ``paramshard --help``: its docstring's first paragraph, on one line.

    The first paragraph, not the first line: a sentence that wraps in the source would be cut
    mid-sentence in the command list."""
    return " ".join(cleandoc(doc).split("\n\n", 1)[0].split())


# `python -m paramshard` and `python -c` both put the current directory first on sys.path, so a
# server started from a user's folder would import that folder's logging.py, grpc.py or
# paramshard.py instead of the real ones (the console script `paramshard` does not). `-P` stops
# that from Python 3.11 only; this removes the entry itself before anything else is imported,
# on 3.10 too, and leaves sys.path alone where PYTHONSAFEPATH already kept the entry out.
_SAFE_MAIN = (
    "import sys; sys.path[:1] == [''] and sys.path.pop(0); "
    "from paramshard.cli import main; sys.exit(main())"
)


def paramshard_argv(*args: str) -> list[str]:
    """The command line that runs ``paramshard ARGS`` in a new interpreter (this one's), whatever
    files the current directory holds."""
    if not sys.executable:
        raise CommandError("cannot start paramshard: no sys.executable")
    return [sys.executable, "-c", _SAFE_MAIN, *args]


# ------------------------------------------------------------------------------ argument types
def _parsed(kind: Any, text: str, what: str) -> Any:
    """``kind(text)``, or the usage error argparse shows as it is (its own names the type
    function: "invalid positive_int value")."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def port_number(text: str) -> int:
    port = _parsed(int, text, "a port number")
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0..65535 (0 picks a free one)")
    return port


MOST = 1e9
"""The largest number a flag of seconds or sizes takes: a billion seconds is 31 years, and
time arithmetic (a deadline, a wait) and gRPC's 32-bit settings overflow not far above it
(``--grace inf`` or ``--max-wait-s 1e10`` ended in a traceback)."""
MOST_INT = 2**31 - 1
"""The largest count a flag takes: gRPC's and protobuf's 32-bit fields."""


def positive(text: str) -> float:
    value = _parsed(float, text, "a positive number")
    if not 0 < value <= MOST:
        raise argparse.ArgumentTypeError(f"{text} is not a number in (0, {MOST:g}]")
    return value


def non_negative(text: str) -> float:
    value = _parsed(float, text, "a number >= 0")
    if not 0 <= value <= MOST:
        raise argparse.ArgumentTypeError(f"{text} is not a number in [0, {MOST:g}]")
    return value


def int_in(low: int, high: int = MOST_INT) -> Callable[[str], int]:
    """An argument type: an integer in ``low..high``."""

    what = f"an integer >= {low}" if high == MOST_INT else f"an integer in {low}..{high:,}"

    def parse(text: str) -> int:
        value = _parsed(int, text, what)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is not an integer in {low}..{high:,}")
        return value

    return parse


positive_int = int_in(1)


def warn(message: str) -> None:
    print(f"paramshard: warning: {message}", file=sys.stderr, flush=True)


def note(message: str) -> None:
    """A line on stderr that says what a command decided for the user (stdout stays data)."""
    print(f"paramshard: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------ the cluster and tables, for client commands
RUN = Arg(
    ("--run",),
    {
        "metavar": "RUN_ID",
        "dest": "run_id",  # args.run is the command itself (paramshard/cli.py)
        "default": None,
        "help": "the run of paramshard launch whose servers to use, when several are alive"
        " (without --servers and $PARAMSHARD_SERVERS, the one alive is used)",
    },
)


def cluster_spec(
    servers: str | None, run: str | None = None, *, role: str = "admin"
) -> ClusterSpec:
    """The cluster as ``paramshard launch`` describes it in the environment (token, TLS files),
    with ``servers`` (``--servers``) standing in for PARAMSHARD_SERVERS when given. With
    neither, the run ``paramshard launch`` is running (``run``: ``--run``, else the only one
    alive; paramshard/run_files.py), its token taken from its token file (``role``'s token of
    a server token file first, a tool needs it for snapshot and restore)."""
    from paramshard.client import ClusterSpec

    overlay: dict[str, str] = {}
    if servers is not None:
        overlay["PARAMSHARD_SERVERS"] = servers
    elif run is not None or not os.environ.get("PARAMSHARD_SERVERS", "").strip():
        overlay = _launched(run, role)
    saved = {k: os.environ.get(k) for k in overlay}
    os.environ.update(overlay)  # ClusterSpec.from_env stays the one reader of PARAMSHARD_*
    try:
        return ClusterSpec.from_env()
    except (ValueError, OSError) as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _launched(run: str | None, role: str) -> dict[str, str]:
    """The settings of a run of ``paramshard launch`` (its run file), for ``cluster_spec``;
    what the environment sets already (a token, TLS files) wins."""
    from paramshard import run_files

    try:
        found = run_files.find(run)
    except run_files.RunLookupError as exc:
        if run is not None:
            raise CommandError(str(exc), EXIT_USAGE) from None
        raise CommandError(
            f"no servers: pass --servers HOST:PORT,..., set PARAMSHARD_SERVERS, or start the job"
            f" with paramshard launch ({exc})",
            EXIT_USAGE,
        ) from None
    note(f"using run {found.describe()}")
    overlay = {
        k: v for k, v in found.env().items() if k == "PARAMSHARD_SERVERS" or k not in os.environ
    }
    if found.token_file and "PARAMSHARD_TOKEN" in os.environ:  # said: a stale one is refused
        note(f"the token is PARAMSHARD_TOKEN's, not the run's token file {found.token_file}")
    elif found.token_file:
        token = read_token(found.token_file, prefer=(role, *ROLES_DOWN[role]))
        if token:
            overlay["PARAMSHARD_TOKEN"] = token
    return overlay


ROLES_DOWN = {"admin": ("train", "read"), "train": ("admin",), "read": ("train", "admin")}
"""Which token of a server token file a caller needing a role takes after that role's own."""


def server_tokens(path: str, text: str | None = None) -> dict[str, Any]:
    """The tokens of server token file ``path`` (``ROLE TOKEN`` lines), as ``paramshard serve
    --token-file`` takes them; ``text``: what to read instead of the file (launch's copy of
    it). CommandError naming what is wrong, and a warning when others may read the file."""
    from paramshard.server.rpc.tokens import (
        parse_token_file,
        read_token_file,
        token_file_is_private,
    )

    try:
        tokens = parse_token_file(read_token_file(path) if text is None else text, path)
    except (OSError, ValueError) as exc:
        raise CommandError(f"--token-file: {exc}", EXIT_USAGE) from None
    if not token_file_is_private(path):
        warn(f"{path} is readable by group or others (chmod 600 it)")
    return tokens


def token_lines(path: str) -> list[list[str]]:
    """The words of each line of token file ``path`` but comments; CommandError naming why
    it cannot be read."""
    from paramshard.server.rpc.tokens import read_token_file

    try:
        lines = [ln.split() for ln in read_token_file(path).splitlines()]
    except OSError as exc:
        raise CommandError(
            f"--token-file: cannot read {path}: {exc.strerror}", EXIT_USAGE
        ) from None
    except ValueError as exc:  # too long, or not UTF-8
        raise CommandError(f"--token-file: {exc}", EXIT_USAGE) from None
    return [ln for ln in lines if ln and not ln[0].startswith("#")]


def bare_token(path: str, lines: list[list[str]]) -> str | None:
    """The token of a token file of one word (``lines``: ``token_lines(path)``), or None. A
    role name alone is a ``ROLE TOKEN`` line that lost its token: taken as a token, it became
    the ranks' secret and the admin token of launch's servers, a word anybody could guess."""
    if len(lines) != 1 or len(lines[0]) != 1:
        return None
    from paramshard.server.rpc.tokens import ROLES

    if lines[0][0] in ROLES:
        raise CommandError(
            f"--token-file {path}: its one line is the role name {lines[0][0]!r} with no token"
            " after it (expected one token, or 'ROLE TOKEN' lines)",
            EXIT_USAGE,
        )
    return lines[0][0]


def read_token(path: str | None, prefer: Sequence[str] = ("train", "admin")) -> str | None:
    """The token in the file ``path`` (``--token-file``): either the bare token, or a server
    token file (``ROLE TOKEN [SCOPE]`` per line, as ``paramshard serve --token-file`` reads)
    whose first token of the first role of ``prefer`` it has is taken, so one secret file can
    serve all."""
    if path is None:
        return None
    lines = token_lines(path)
    if (bare := bare_token(path, lines)) is not None:
        return bare
    by_role: dict[str, str] = {}
    for ln in lines:  # ROLE TOKEN, and the scope a server reads (jobs=..., runs=...)
        if len(ln) >= 2:
            by_role.setdefault(ln[0], ln[1])
    for role in prefer:
        if role in by_role:
            return by_role[role]
    raise CommandError(
        f"--token-file {path}: expected one token, or 'ROLE TOKEN' lines with a"
        f" {' or '.join(prefer)} token",
        EXIT_USAGE,
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: frozenset[int]) -> str:
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), *(line(row) for row in rows)])


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    """``seconds`` as 42s, 3m07s, 5h02m or 2d03h; "?" for a time that cannot be (a server's
    NaN, infinite or negative uptime or age)."""
    if not 0 <= seconds < 2**53:
        return "?"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
