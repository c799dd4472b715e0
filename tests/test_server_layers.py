"""The import graph: the server's packages in layers, no circles anywhere, private names kept.

Every import counts, the ones inside functions and under ``TYPE_CHECKING`` included: a circle
through a type-only import still ties two modules together for a reader. Read from the source
with ``ast``, so nothing is imported and no import order can hide an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {  # the installed name -> its folder (pyproject.toml's package-dir)
    "paramshard.protos": ROOT / "protos",
    "paramshard.server": ROOT / "server",
    "paramshard.client": ROOT / "client",
    "paramshard.strategies": ROOT / "strategies",
    "paramshard": ROOT / "paramshard",
}
SERVER_LAYERS = (
    "runtime",
    "optimizers",
    "snapshots",
    "buffers",
    "collectives",
    "rpc",
    "transport",
    "replication",
)
"""The server's sub-packages, lowest first (server/__init__.py): each imports only from its own
and lower ones; the server's top-level modules (servicer, status, ...) import from any."""


def _modules() -> dict[str, Path]:
    """Every module of the installed package: dotted name -> file."""
    out: dict[str, Path] = {}
    for prefix, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[0] in {"protos", "server", "client", "strategies"} and prefix == "paramshard":
                continue  # (none: those live beside paramshard/, not in it)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(imported module, name taken from it or "", line) for each import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((a.name, "", node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append(
                    (full, "", node.lineno) if full in MODULES else (base, a.name, node.lineno)
                )
    return out


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for target, _, _ in _imports(name, path):
            if target in MODULES and target != name:
                graph[name].add(target)
    return graph


def _layer(module: str) -> str | None:
    """The server sub-package of ``module``; None for the server's top-level modules."""
    parts = module.split(".")  # paramshard.server.<package>[.<module>]
    return parts[2] if len(parts) > 2 and parts[2] in SERVER_LAYERS else None


def test_every_server_import_flows_down_the_layers() -> None:
    wrong = []
    for name, path in MODULES.items():
        if not name.startswith("paramshard.server."):
            continue
        here = _layer(name)
        for target, _, line in _imports(name, path):
            if target.startswith(("paramshard.client", "paramshard.strategies", "torch")):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
            if not target.startswith("paramshard.server.") or here is None:
                continue
            there = _layer(target)
            if there is None:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports the top-level {target}")
            elif SERVER_LAYERS.index(there) > SERVER_LAYERS.index(here):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {here} imports upward, {target}")
    assert not wrong, "\n".join(wrong)


def test_every_server_package_is_a_layer() -> None:
    folders = {p.parent.name for p in (ROOT / "server").glob("*/__init__.py")}
    assert folders == set(SERVER_LAYERS)


def test_protos_stand_below_both_sides() -> None:
    """protos/ (the wire contract, codec, slice rule, shared memory) imports no other part."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for name, path in MODULES.items()
        if name.startswith("paramshard.protos")
        for target, _, line in _imports(name, path)
        if target.startswith(("paramshard.", "torch"))
        and not target.startswith("paramshard.protos")
    ]
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    """A package's ``__init__`` that re-exports its modules is not a circle with them: the edges
    from a module to its own package's ``__init__`` are the only ones left out."""
    graph = _edges()
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(f"{t}.")}
    assert not _cycles(graph)


def test_the_cycle_finder_finds_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("prefix", ["paramshard.server", "paramshard"])
def test_no_private_name_leaves_its_module(prefix: str) -> None:
    """``from module import _name`` and ``module._name`` name another module's private part."""
    wrong = []
    for name, path in MODULES.items():
        if not name.startswith(prefix):
            continue
        tree = ast.parse(path.read_text())
        aliases = {}
        for target, taken, line in _imports(name, path):
            if taken.startswith("_") and not taken.startswith("__") and target in MODULES:
                wrong.append(f"{path.relative_to(ROOT)}:{line} takes {target}.{taken}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    if f"{node.module}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in MODULES:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                wrong.append(
                    f"{path.relative_to(ROOT)}:{node.lineno} uses {aliases[node.value.id]}"
                    f".{node.attr}"
                )
    assert not wrong, "\n".join(wrong)
