"""protos/atomic.py replaces what ``open(path, "w")`` would write to, and nothing else.

A symbolic link is followed (the link stays, its target gets the new contents); a folder, a
fifo or a device is refused with an error naming it, where a rename would have put a regular
file in its place (``paramshard export --out /dev/full``, run as root, once replaced the
device node). ``paramshard export`` says so in one line, before it reads anything.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from paramshard.protos.atomic import atomic_write, write_bytes

ROOT = Path(__file__).resolve().parents[1]


def entries(folder: Path) -> list[str]:
    """The names in ``folder``: a temporary file left behind would show here."""
    return sorted(p.name for p in folder.iterdir())


def test_a_new_file_and_an_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    write_bytes(path, b"first")
    assert path.read_bytes() == b"first"
    path.chmod(0o600)
    write_bytes(path, b"second")
    assert path.read_bytes() == b"second"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # as an overwrite in place keeps it
    assert entries(tmp_path) == ["model.bin"]


def test_a_link_is_followed_and_stays_a_link(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "real.safetensors").write_bytes(b"old")
    link = tmp_path / "latest.safetensors"
    link.symlink_to("models/real.safetensors")  # relative, as `ln -s` makes them
    chain = tmp_path / "chain.safetensors"
    chain.symlink_to(link)

    with atomic_write(link) as f:
        f.write(b"new")
    assert link.is_symlink() and os.readlink(link) == "models/real.safetensors"
    assert (models / "real.safetensors").read_bytes() == b"new"

    write_bytes(chain, b"newer")  # a link to a link: the last target is written
    assert chain.is_symlink() and link.is_symlink()
    assert (models / "real.safetensors").read_bytes() == b"newer"
    assert entries(models) == ["real.safetensors"]  # the temporary file was in the target's folder
    assert entries(tmp_path) == ["chain.safetensors", "latest.safetensors", "models"]


def test_a_dangling_link_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "out.bin"
    link.symlink_to("target.bin")
    write_bytes(link, b"data")  # as open(link, "wb") and torch.save do
    assert link.is_symlink() and (tmp_path / "target.bin").read_bytes() == b"data"


def test_a_fifo_is_refused_and_left_alone(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="is a fifo, not a regular file") as caught:
        with atomic_write(fifo) as f:
            f.write(b"never")
    assert caught.value.filename == str(fifo)
    link = tmp_path / "to-pipe"
    link.symlink_to(fifo)
    with pytest.raises(OSError, match=f"is a fifo \\(a link to {fifo}\\)"):
        write_bytes(link, b"never")
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and link.is_symlink()
    assert entries(tmp_path) == ["pipe", "to-pipe"]


def test_a_folder_is_refused_and_left_alone(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "inside").write_text("kept")
    with pytest.raises(IsADirectoryError, match="is a folder, not a regular file"):
        write_bytes(folder, b"never")
    assert (folder / "inside").read_text() == "kept"
    assert entries(tmp_path) == ["out"]


def test_export_refuses_a_fifo_in_one_line(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    result = subprocess.run(
        [sys.executable, "-m", "paramshard", "export", "--snapshot", str(tmp_path / "j" / "t")]
        + ["--out", str(fifo)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"paramshard export: error: --out {fifo}: is a fifo, not a regular file: not replaced\n"
    )
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
