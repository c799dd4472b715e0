"""The tokens ``paramshard launch``'s local servers check (``--token-file`` without
``--servers``), from a private file of the launcher's, removed as it ends: a server token
file's lines (``ROLE TOKEN``) as the user wrote them, or one bare token, the ranks', as the
``admin`` token (the launcher's own servers belong to whoever holds it, and ranks that take
checkpoints need admin: snapshots and restores are admin calls); and a ``peer`` token of
their own, where the file has none, so that they replicate to each other
(``replicate_every``). The file is checked as the launcher starts, its errors naming the
user's file and lines, and a file others may read is warned of, as ``paramshard serve``
does. Before, the local servers were started without tokens whatever the file said: any
process of the host could call them, with a mistyped token or a read token."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile

from paramshard.commands import (
    EXIT_USAGE,
    CommandError,
    bare_token,
    server_tokens,
    token_lines,
)
from paramshard.server.rpc.tokens import MAX_TOKEN_FILE_BYTES, read_token_file

__all__ = ["LocalTokens"]


class LocalTokens:
    """The token file of launch's local servers: ``serve_args`` makes it, ``close`` removes
    it (made before anything can fail in between: a launcher stopped meanwhile leaves no
    file behind)."""

    def __init__(self) -> None:
        self._folder: str | None = None

    def serve_args(self, path: str | None) -> list[str]:
        """``--token-file COPY`` for the local servers of a launcher given ``--token-file
        path`` (nothing without one); CommandError naming what is wrong with the file."""
        if path is None:
            return []
        lines = token_lines(path)
        if (bare := bare_token(path, lines)) is not None:  # one bare token: the ranks'
            text = f"admin {bare}\n"
        else:
            text = read_token_file(path)  # as written: an error names the file's own line
        server_tokens(path, text)  # checked, and warned of, as the servers would
        if not any(words[0] == "peer" for words in lines):
            text += ("\n" if text and not text.endswith("\n") else "") + "peer "
            text += secrets.token_hex(32) + "\n"
        if len(text) > MAX_TOKEN_FILE_BYTES:
            raise CommandError(
                f"--token-file {path}: no room for the local servers' own peer line (a token"
                f" file holds {MAX_TOKEN_FILE_BYTES:,} characters): add a 'peer TOKEN' line",
                EXIT_USAGE,
            )
        self._folder = tempfile.mkdtemp(prefix="paramshard-tokens-")  # 0700
        made = os.path.join(self._folder, "tokens")
        fd = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return ["--token-file", made]

    def close(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
