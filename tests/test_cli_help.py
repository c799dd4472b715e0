"""``paramshard --help`` lists each command with whole sentences (issue 25): a command's line is
its docstring's first paragraph however it wraps in the source, not its first line."""

from __future__ import annotations

import argparse
import contextlib
import io
from inspect import cleandoc

import pytest

from paramshard.cli import build_parser
from paramshard.commands import COMMANDS, summary


def _words(text: str) -> str:
    return " ".join(text.split())


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    return out.getvalue()


def test_summary_is_the_whole_first_paragraph() -> None:
    doc = """Snapshot a job on one version while it trains; each server writes its shard into its
    --snapshot-dir, then the manifest is committed.

    More detail that the command list leaves out."""
    assert summary(doc) == (
        "Snapshot a job on one version while it trains; each server writes its shard into its"
        " --snapshot-dir, then the manifest is committed."
    )


def test_every_command_line_in_help_is_whole_sentences() -> None:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    listed = {a.dest: a.help for a in sub._choices_actions}
    assert set(listed) == set(COMMANDS) and len(listed) >= 10, sorted(listed)
    text = _words(_help(["--help"]))
    for name, cmd in COMMANDS.items():
        doc = cleandoc(cmd.run.__doc__ or "")
        first_paragraph = _words(doc.split("\n\n", 1)[0])
        assert listed[name] == first_paragraph, name
        assert first_paragraph.endswith((".", ")")), (
            f"{name}: {first_paragraph!r} ends mid-sentence"
        )
        assert first_paragraph in text, f"{name}: its line is cut in paramshard --help"


def test_each_command_help_shows_its_whole_description() -> None:
    build_parser()  # registers the commands
    for name, cmd in COMMANDS.items():
        doc = cleandoc(cmd.run.__doc__ or "")
        assert doc, f"paramshard {name} has no docstring to describe it"
        assert doc in _help([name, "--help"]), f"paramshard {name} --help cuts its description"
        assert doc.endswith((".", ")", ":")), f"{name}: its description ends mid-sentence"
