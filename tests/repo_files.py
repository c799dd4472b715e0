"""The project's own text files, for tests that read all of them (tests/test_bare_names.py,
tests/test_design_refs.py): code, docs, Dockerfiles, Makefile, CI script, compose and
Kubernetes files; never the virtualenv, git's or a build's files, nor protoc's output."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__", ".hypothesis", "runs"}
SUFFIXES = {".py", ".pyi", ".md", ".yaml", ".yml", ".proto", ".sh", ".cfg", ".ini", ".txt"}


def text_files() -> Iterator[Path]:
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(
            d for d in dirs if d not in SKIP_DIRS and not d.endswith((".egg-info", "_cache"))
        )
        for name in sorted(names):
            path = Path(folder, name)
            if _is_text(path):
                yield path


def _is_text(path: Path) -> bool:
    if path.name.startswith("shard_pb2"):  # generated from shard.proto, checked against it
        return False
    return (
        path.suffix in SUFFIXES
        or path.name.startswith("Dockerfile")
        or path.name.endswith(".dockerignore")
        or path.name == "Makefile"
        or path.relative_to(ROOT).as_posix() == ".ci/run"
    )
