"""The tokens ``paramshard launch``'s local servers check (``--token-file`` without
``--servers``), from a private file of the launcher's, removed as it ends: a server token
file's lines (``ROLE TOKEN``), or one bare token, the ranks', as the ``admin`` token (the
launcher's own servers belong to whoever holds it, and ranks that take checkpoints need admin:
snapshots and restores are admin calls); and a ``peer`` token of their own, where the file has
none, so that they replicate to each other (``replicate_every``). Before, the local servers
were started without tokens whatever the file said: any process of the host could call them,
with a mistyped token or a read token."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile

from paramshard.commands import EXIT_USAGE, CommandError, token_lines
from paramshard.server.rpc.tokens import parse_token_file

__all__ = ["LocalTokens"]


class LocalTokens:
    """``serve_args``: the ``--token-file`` of launch's local servers, if any; ``close``
    removes the file made for them."""

    def __init__(self, path: str | None) -> None:
        self.serve_args: list[str] = []
        self._folder: str | None = None
        if path is None:
            return
        lines = token_lines(path)
        if len(lines) == 1 and len(lines[0]) == 1:  # one bare token
            lines = [["admin", lines[0][0]]]
        if not any(words[0] == "peer" for words in lines):
            lines.append(["peer", secrets.token_hex(32)])
        text = "".join(" ".join(words) + "\n" for words in lines)
        try:  # said here, naming the file: not by each server, naming the copy
            parse_token_file(text, source=path)
        except ValueError as exc:
            raise CommandError(f"--token-file: {exc}", EXIT_USAGE) from None
        self._folder = tempfile.mkdtemp(prefix="paramshard-tokens-")  # 0700
        made = os.path.join(self._folder, "tokens")
        fd = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        self.serve_args = ["--token-file", made]

    def close(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
