"""Tokens and their roles: what a ``tokens`` mapping or a token file may say, checked once.

A token file has one ``ROLE TOKEN [jobs=PATTERNS] [runs=PATTERNS]`` per line (scopes:
server/rpc/scopes.py); ``ServerConfig.security.tokens`` holds the same as ``{token: grant}``.
Who may then call what is server/rpc/auth.py's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from paramshard.server.rpc.scopes import Grant, parse_scope

__all__ = [
    "LADDER",
    "PEER",
    "ROLES",
    "check_tokens",
    "grant_of",
    "load_token_file",
    "read_token_file",
    "parse_token_file",
    "peer_token",
    "token_file_is_private",
]

LADDER = ("read", "train", "admin")
"""From least to most: a token's role includes every role before it."""
PEER = "peer"
ROLES = (*LADDER, PEER)
"""Every role a token may have: the ladder, and ``peer`` (servers only) apart from it."""


def grant_of(value: str | Grant) -> Grant:
    """A ``tokens`` value as a Grant: a role (``"train"``), a role and its scope
    (``"train jobs=team-a-*"``, as after the token in a token file), or a Grant."""
    if isinstance(value, Grant):
        grant = value
    elif isinstance(value, str) and value.split():
        role, *scope = value.split()
        grant = Grant(role, parse_scope(scope))
    else:
        raise ValueError(f"a token's grant is a role or a Grant, not {value!r:.64}")
    if grant.role not in ROLES:
        raise ValueError(f"unknown role {grant.role!r} (roles: {', '.join(ROLES)})")
    if grant.role == PEER and grant.scope is not None:
        raise ValueError(
            "a peer token takes no jobs= or runs=: it is the servers' own, and carries every"
            " job's replicas to the neighbour server"
        )
    return grant


def peer_token(tokens: Mapping[str, str | Grant]) -> str | None:
    """The token this server sends to its peers (the first ``peer`` line), None without one."""
    return next((t for t, g in tokens.items() if grant_of(g).role == PEER), None)


def check_tokens(tokens: Mapping[str, str | Grant]) -> dict[str, str | Grant]:
    """Validates ``{token: grant}``: each grant a role, a role and its scope
    (``"train jobs=team-a-*"``) or a ``Grant``; tokens usable as gRPC metadata. An unscoped
    token maps to its role, as ``{token: role}`` always did; a scoped one to its Grant."""
    out: dict[str, str | Grant] = {}
    for token, value in tokens.items():
        grant = grant_of(value)
        if not isinstance(token, str) or not token:
            raise ValueError("a token must be a non-empty string")
        if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
            raise ValueError(
                f"a token of role {grant.role!r} has whitespace or non-printable / non-ASCII"
                " characters (it travels as an 'authorization: Bearer TOKEN' header)"
            )
        out[token] = grant.role if grant.scope is None else grant
    return out


def parse_token_file(text: str, source: str = "token file") -> dict[str, str | Grant]:
    """``ROLE TOKEN [jobs=PATTERNS] [runs=PATTERNS]`` per line (roles read, train, admin,
    peer; patterns server/rpc/scopes.py); blank lines and lines starting with ``#`` are
    skipped. An unscoped token maps to its role, a scoped one to its Grant."""
    tokens: dict[str, str | Grant] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"{source} line {number}"
        role, token, *scope = parts + [""] * (2 - len(parts))
        if len(parts) < 2 or any("=" not in field for field in scope):
            raise ValueError(
                f"{where}: expected 'ROLE TOKEN' and then only jobs=PATTERNS or runs=PATTERNS,"
                f" got {len(parts)} fields"
            )
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r} (roles: {', '.join(ROLES)})")
        try:
            checked = check_tokens({token: " ".join([role, *scope])})
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if token in tokens and tokens[token] != checked[token]:
            raise ValueError(
                f"{where}: the same token is listed as {str(tokens[token])!r} and"
                f" {str(checked[token])!r}"
            )
        tokens.update(checked)
    if not tokens:
        raise ValueError(f"{source} has no tokens (expected lines 'ROLE TOKEN')")
    return tokens


MAX_TOKEN_FILE_BYTES = 16 * 2**20
"""The largest token file read (tens of thousands of tokens): ``--token-file /dev/zero`` read
for ever."""


def read_token_file(path: str) -> str:
    """The text of token file ``path``; ValueError past ``MAX_TOKEN_FILE_BYTES``."""
    with open(path, encoding="utf-8") as f:
        text = f.read(MAX_TOKEN_FILE_BYTES + 1)
    if len(text) > MAX_TOKEN_FILE_BYTES:
        raise ValueError(f"{path} is longer than a token file ({MAX_TOKEN_FILE_BYTES:,} bytes)")
    return text


def load_token_file(path: str) -> dict[str, str | Grant]:
    return parse_token_file(read_token_file(path), path)


def token_file_is_private(path: str) -> bool:
    """False when group or others may read the file (worth a warning)."""
    try:
        return os.stat(path).st_mode & 0o077 == 0
    except OSError:
        return True
