"""The ``paramshard`` command: every subcommand registers itself with ``@command``
(paramshard/commands.py); this module builds the parser from them and runs one.

``serve``: paramshard/serve_cli.py; ``health``: health_cli.py; ``launch``: launch.py;
``status``: status_cli.py; ``inspect``, ``get``, ``snapshot``, ``snapshots``, ``restore``, ``drop``,
``delete-snapshot``, ``export``:
tools_cli.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from inspect import cleandoc

from paramshard import __version__
from paramshard.commands import COMMANDS, EXIT_USAGE, CommandError, summary
from paramshard.terminal import Printable

__all__ = ["main", "build_parser", "CommandError"]


def build_parser() -> argparse.ArgumentParser:
    import paramshard.serve_cli  # noqa: F401 - registers serve (listed first)
    import paramshard.health_cli  # noqa: F401 - registers health  # isort: skip
    import paramshard.launch  # noqa: F401 - registers launch  # isort: skip
    import paramshard.status_cli  # noqa: F401 - registers status
    import paramshard.tools_cli  # noqa: F401 - registers inspect, get, snapshot, restore, export

    parser = argparse.ArgumentParser(
        prog="paramshard",
        description="Train PyTorch models over gRPC shard servers.",
    )
    parser.add_argument("--version", action="version", version=f"paramshard {__version__}")
    # not required here: main names an unknown option given without a command itself
    # (argparse would say only that COMMAND is missing)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS.values():
        doc = cleandoc(cmd.run.__doc__ or "")
        p = sub.add_parser(
            cmd.name,
            help=summary(doc),
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for a in cmd.args:
            p.add_argument(*a.flags, **a.options)
        p.set_defaults(run=cmd.run, command_parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``paramshard ARGS``: returns the exit code (argparse exits 2 itself on bad arguments,
    or the command's own ``usage_exit``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parsed(build_parser(), argv)
    except SystemExit as exc:
        cmd = COMMANDS.get(argv[0]) if argv else None
        if exc.code == EXIT_USAGE and cmd is not None:
            raise SystemExit(cmd.usage_exit) from None  # health's 1: Docker reserves 2
        raise
    args.argv = argv  # serve re-executes itself with exactly these arguments
    out, err = sys.stdout, sys.stderr
    wrap = not isinstance(out, Printable)  # a main running in another thread wrapped them
    if wrap:  # a server's text: paramshard/terminal.py
        sys.stdout, sys.stderr = Printable(out), Printable(err)
    try:
        return args.run(args)
    except CommandError as exc:
        print(f"paramshard {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    finally:
        if wrap:
            sys.stdout, sys.stderr = out, err


def _parsed(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        names = ", ".join(sorted(COMMANDS))
        if unknown:
            parser.error(
                f"unrecognized arguments: {' '.join(unknown)} (a COMMAND comes first: {names})"
            )
        parser.error(f"a COMMAND is required: one of {names}")
    if unknown:  # with the command's usage, not the top level's
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args
