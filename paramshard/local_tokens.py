"""The tokens ``paramshard launch``'s local servers check (``--token-file`` without
``--servers``). A server token file (``ROLE TOKEN`` lines) is given to them as it is. A file
of one bare token, the ranks' token, makes a private file of its own that grants that token
the ``admin`` role: the launcher's own servers belong to whoever holds the token, and ranks
that take checkpoints need admin (snapshots and restores are admin calls). It is removed when
the launcher ends. Before, the local servers were started without tokens whatever the file
said: any process of the host could call them, a mistyped token and a read token included."""

from __future__ import annotations

import os
import shutil
import tempfile

from paramshard.commands import has_roles, read_token

__all__ = ["LocalTokens"]


class LocalTokens:
    """``serve_args``: the ``--token-file`` of launch's local servers, if any; ``close``
    removes a file made for them."""

    def __init__(self, path: str | None) -> None:
        self.serve_args: list[str] = []
        self._folder: str | None = None
        if path is None:
            return
        if has_roles(path):
            self.serve_args = ["--token-file", os.path.abspath(path)]
            return
        token = read_token(path)
        self._folder = tempfile.mkdtemp(prefix="paramshard-tokens-")  # 0700
        made = os.path.join(self._folder, "tokens")
        fd = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"admin {token}\n")
        self.serve_args = ["--token-file", made]

    def close(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
