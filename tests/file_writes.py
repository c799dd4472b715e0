"""What ``write_safetensors`` writes, as it writes it: each ``write`` to a file that
protos/atomic.py opens (``atomic_write``'s) is shown to the test first
(tests/test_export.py, tests/test_export_memory.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paramshard.protos import atomic


def record_writes(monkeypatch: Any, seen: Callable[[Any], object]) -> None:
    """``seen(data)`` for each ``write(data)`` to the files ``atomic`` opens, for the rest of
    the test."""
    real_open = open

    class Recorder:
        def __init__(self, f: Any) -> None:
            self.f = f

        def write(self, data: Any) -> int:
            seen(data)
            return self.f.write(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def __enter__(self) -> Recorder:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    monkeypatch.setattr(atomic, "open", lambda *a, **k: Recorder(real_open(*a, **k)), raising=False)
