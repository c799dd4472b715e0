"""No file of the project names a module by its folder's bare name (issue 25): ``protos``,
``server``, ``client``, ``strategies`` install as ``paramshard.<part>``, the example GPT as
``paramshard.models.gpt``, and ``examples/`` holds scripts only.

ruff's banned imports (pyproject.toml) refuse import statements; this reads what ruff does not:
strings in Python code (a command line, a ``monkeypatch.setattr("server.x.y", ...)`` target, a
``python -c`` program), comments and docstrings, and the docs, Dockerfiles, Makefile, CI script,
compose and Kubernetes files.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

from repo_files import ROOT, text_files

BARE = ("protos", "server", "client", "strategies", "examples")
_B = "|".join(BARE)

PATTERNS = (
    # python -m protos.generate, python -m server
    re.compile(rf"\bpython3?\s+-m\s+(?:{_B})\b"),
    # from server import X, from server.app import Y (not: from paramshard.server import)
    re.compile(rf"(?<![\w.])from\s+(?:{_B})(?:\.\w+)*\s+import\b"),
    # the example GPT's old module
    re.compile(r"\bexamples[./]gpt\b"),
    # a dotted path in quotes: "server.slots.X", 'client.rpc' (a file name such as
    # 'server.py' is no module path)
    re.compile(rf"""["'](?:{_B})\.(?!py\b)[A-Za-z_]\w*"""),
)
IMPORT_LIST = re.compile(
    r"(?<![\w.])import\s+([\w.]+(?:\s+as\s+\w+)?(?:\s*,\s*[\w.]+(?:\s+as\s+\w+)?)*)"
)
FROM_BEFORE = re.compile(r"\bfrom\s+\S+\s+$")  # `from hypothesis import strategies` is fine


def project_files() -> Iterator[Path]:
    here = Path(__file__).resolve()
    return (path for path in text_files() if path != here)  # its examples are bare on purpose


def bare_names(text: str) -> list[str]:
    """The bare module references in ``text``."""
    hits = [m.group(0) for pattern in PATTERNS for m in pattern.finditer(text)]
    for m in IMPORT_LIST.finditer(text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        if FROM_BEFORE.search(text[line_start : m.start()]):
            continue
        for item in m.group(1).split(","):
            if item.split()[0].split(".")[0] in BARE:
                hits.append(f"import {item.strip()}")
    return hits


def python_texts(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each string constant (adjacent literals joined, as a program split over
    lines is one string) and each comment of a Python file."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def texts(path: Path) -> Iterator[tuple[int, str]]:
    source = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".py":
        yield from python_texts(source)
    else:
        yield from enumerate(source.splitlines(), 1)


def test_the_patterns_find_bare_names() -> None:
    """What the scan must catch and what it must let pass, so it cannot pass by finding nothing."""
    found = [
        "python -m protos.generate",
        "from server import ShardServer",
        "import sys, numpy as np, client, protos.codec",
        "from paramshard.models import gpt  # was examples.gpt",
        'monkeypatch.setattr("server.slots.PENDING_TTL_S", 1)',
    ]
    for text in found:
        assert bare_names(text), text
    allowed = [
        "python -m paramshard.protos.generate",
        "from paramshard.server import ShardServer",
        "import sys, paramshard.client, paramshard.protos.codec",
        "from hypothesis import strategies as st",
        "a user's 'server.py' or \"client.py\" beside the script",
        'monkeypatch.setattr("paramshard.server.slots.PENDING_TTL_S", 1)',
    ]
    for text in allowed:
        assert not bare_names(text), text
    code = 'run("import sys, paramshard.server,"\n    " server.app")  # joined: one program\n'
    assert [hit for _, text in python_texts(code) for hit in bare_names(text)] == [
        "import server.app"
    ]


def test_no_file_names_a_module_by_its_bare_name() -> None:
    files = list(project_files())
    assert ROOT / "README.md" in files and ROOT / "docker" / "Dockerfile" in files
    found = [
        f"{path.relative_to(ROOT)}:{line}: {hit}"
        for path in files
        for line, text in texts(path)
        for hit in bare_names(text)
    ]
    assert not found, "bare module names (use paramshard.<part>):\n" + "\n".join(found)
