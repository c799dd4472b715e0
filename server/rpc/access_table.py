"""The role × method × scope table of docs/security.md, made from the rules themselves
(``auth.METHOD_ROLES`` and ``scopes.ROUTES``), so the documentation cannot drift from the code:
tests/test_token_scopes.py checks that the document holds this table.

``python -m paramshard.server.rpc.access_table`` prints it.
"""

from __future__ import annotations

from paramshard.protos import shard_pb2 as pb
from paramshard.server.rpc import auth, tokens
from paramshard.server.rpc.scopes import ROUTES

__all__ = ["markdown"]


def markdown() -> str:
    """One row per method of the Shard service, in shard.proto's order: which roles may call
    it, and what a token scoped with ``jobs=``/``runs=`` may do with it."""
    lines = [
        "| Method | " + " | ".join(f"`{r}`" for r in tokens.ROLES) + " | Scoped token |",
        "|---|" + "---|" * len(tokens.ROLES) + "---|",
    ]
    for method in pb.DESCRIPTOR.services_by_name["Shard"].methods:
        need = auth.required_role(f"/{auth.SERVICE_NAME}/{method.name}")
        assert need is not None  # the Shard service is never open
        cells = ["yes" if auth.role_allows(r, need, method.name) else "-" for r in tokens.ROLES]
        route = ROUTES.get(method.name)
        rule = route.rule if route is not None else "refused (no scope rule)"
        lines.append(f"| `{method.name}` | " + " | ".join(cells) + f" | {rule} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
