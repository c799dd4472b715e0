"""What the command line prints: text a server sent (names, tags, error messages) reaches the
user's terminal with its control characters shown, never obeyed.

A job's parameter names, a snapshot's tag and a server's error details are the server's word: a
server that lies, or a team that named a job so, could otherwise retitle, clear or recolour the
terminal of whoever runs ``paramshard inspect`` or ``status`` (and, on terminals that take
OSC 52, write its clipboard). ``cli.main`` runs every command with its ``sys.stdout`` and
``sys.stderr`` behind ``Printable``; bytes written to their ``buffer`` (a launched rank's own
output, relayed as it came) pass unchanged.
"""

from __future__ import annotations

from typing import Any, TextIO

from paramshard.protos.words import printable

__all__ = ["Printable"]


class Printable:
    """A text stream whose written text goes through ``printable``; all else is the stream's."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(printable(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)
