"""protos/atomic.py: a file is replaced whole or not at all."""

from __future__ import annotations

import pytest

from paramshard.protos.atomic import atomic_write


def test_a_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"old")
    with atomic_write(path) as f:
        f.write(b"new ")
        f.write(b"contents")
    assert path.read_bytes() == b"new contents"
    with atomic_write(tmp_path / "config.json", "w") as f:
        f.write('{"é": 1}\n')
    assert (tmp_path / "config.json").read_text(encoding="utf-8") == '{"é": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.bin"]


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="producer failed"), atomic_write(path) as f:
        f.write(b"half of the ")
        raise RuntimeError("producer failed")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.bin"]
