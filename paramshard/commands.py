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
    "paramshard_argv",
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


COMMANDS: dict[str, Command] = {}
"""Subcommands in registration order (the order ``paramshard --help`` lists them)."""


def command(*args: Arg, name: str | None = None) -> Callable[[Callable], Callable]:
    """Registers the decorated function as subcommand ``name`` (default: the function's name)."""

    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        cmd = name or fn.__name__.replace("_", "-")
        COMMANDS[cmd] = Command(cmd, fn, args)
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
def port_number(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0..65535 (0 picks a free one)")
    return port


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number >= 0")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not an integer >= 1")
    return value


def warn(message: str) -> None:
    print(f"paramshard: warning: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------ the cluster and tables, for client commands
def cluster_spec(servers: str | None) -> ClusterSpec:
    """The cluster as ``paramshard launch`` describes it in the environment (token, TLS files),
    with ``servers`` (``--servers``) standing in for PARAMSHARD_SERVERS when given."""
    from paramshard.client import ClusterSpec

    if servers is None and not os.environ.get("PARAMSHARD_SERVERS", "").strip():
        raise CommandError(
            "no servers: pass --servers HOST:PORT,... or set PARAMSHARD_SERVERS", EXIT_USAGE
        )
    saved = os.environ.get("PARAMSHARD_SERVERS")
    if servers is not None:  # ClusterSpec.from_env stays the one reader of PARAMSHARD_*
        os.environ["PARAMSHARD_SERVERS"] = servers
    try:
        return ClusterSpec.from_env()
    except (ValueError, OSError) as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    finally:
        if saved is None:
            os.environ.pop("PARAMSHARD_SERVERS", None)
        else:
            os.environ["PARAMSHARD_SERVERS"] = saved


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
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
