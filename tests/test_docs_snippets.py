"""Every Python block of README.md and docs/*.md runs as written (issue 25), against real
servers, so the docs cannot drift from the code.

Each block runs as its own script, in a fresh folder, with nothing added: its imports, data and
servers are its own. An HTML comment on the line above a block (invisible on the rendered page)
says how it runs:

- none: ``python block.py`` (a block starts its servers itself: ``LocalCluster``, ``ShardServer``);
- ``<!-- run: paramshard launch --nproc N -->``: under the launcher, N ranks and N local servers
  (flags without a value may follow: ``--elastic``)
  (a block that reads RANK, WORLD_SIZE and PARAMSHARD_SERVERS, as a user's script does);
- ``<!-- run: after the block above -->`` (may follow the launch form, after a comma): the block
  continues the page's previous Python block, and runs appended to it;
- ``<!-- not run: REASON -->``: skipped, saying why (a CUDA device, hosts this machine lacks);
- ``<!-- file: NAME -->`` above a block of any language: written as NAME beside every block of
  that page that runs (a config file the page's code reads).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
COMMENT = re.compile(r"^<!--\s*(run|not run|file):\s*(.*?)\s*-->\s*$")
LAUNCH = re.compile(r"^paramshard launch --nproc (\d+)((?: --[a-z-]+)*)$")  # flags: no values
TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    code: str
    directive: tuple[str, str] | None  # ("run" | "not run" | "file", its text)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, each with the directive on the line above it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a code block never ends"
        above = COMMENT.match(lines[i - 1]) if i > 0 else None
        directive = (above.group(1), above.group(2)) if above else None
        code = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(page, i + 1, m.group(1), code, directive))
        i = end + 1
    return found


def python_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang == "python"]


@dataclass(frozen=True)
class Plan:
    """How one block runs: the script (its predecessors' code first) and the command."""

    script: str
    nproc: int  # 0: plain python
    flags: list[str]  # launch's flags after --nproc N
    files: dict[str, str]


def plan(block: Block) -> Plan:
    page = blocks(block.page)
    files = {b.directive[1]: b.code for b in page if b.directive and b.directive[0] == "file"}
    earlier = [b for b in page if b.lang == "python" and b.line < block.line]
    nproc, after, flags = 0, False, []
    if block.directive and block.directive[0] == "run":
        for option in (o.strip() for o in block.directive[1].split(",")):
            launch = LAUNCH.match(option)
            if launch:
                nproc, flags = int(launch.group(1)), launch.group(2).split()
            elif option == "after the block above":
                after = True
            else:
                raise AssertionError(f"{block.name}: unknown run option {option!r}")
    script = block.code
    if after:
        assert earlier, f"{block.name} runs after the block above, but none is there"
        previous = plan(earlier[-1])
        script, nproc = previous.script + script, nproc or previous.nproc
        flags = flags or previous.flags
    return Plan(script, nproc, flags, files)


SNIPPETS = python_blocks()


def test_the_pages_have_blocks_and_directives_parse() -> None:
    assert len(SNIPPETS) >= 10, [b.name for b in SNIPPETS]
    for block in SNIPPETS:
        if block.directive and block.directive[0] == "not run":
            assert len(block.directive[1]) > 10, f"{block.name}: say why it is not run"
        elif not (block.directive and block.directive[0] == "file"):
            plan(block)  # raises on an unknown option


def test_readme_quick_start_is_two_commands() -> None:
    readme = ROOT / "README.md"
    heading = readme.read_text(encoding="utf-8").splitlines().index("## Quick start") + 1
    first = next(b for b in blocks(readme) if b.line > heading)
    commands = [line.split("#")[0].strip() for line in first.code.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"], commands


def paramshard_command() -> str:
    script = Path(sys.executable).with_name("paramshard")
    assert script.is_file(), f"{script}: no paramshard console script beside this interpreter"
    return str(script)


@pytest.mark.slow
@pytest.mark.parametrize("block", SNIPPETS, ids=[b.name for b in SNIPPETS])
def test_block_runs(block: Block, tmp_path: Path) -> None:
    if block.directive and block.directive[0] == "not run":
        pytest.skip(f"{block.name}: {block.directive[1]}")
    how = plan(block)
    for name, text in how.files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "block.py").write_text(how.script)
    if how.nproc:
        cmd = [paramshard_command(), "launch", "--nproc", str(how.nproc), *how.flags, "block.py"]
    else:
        cmd = [sys.executable, "block.py"]
    # One thread per process: several ranks and servers share this machine's few cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert run.returncode == 0, (
        f"{block.name} failed ({' '.join(cmd[-4:])}):\n{how.script}\n"
        f"--- stdout\n{run.stdout[-6000:]}\n--- stderr\n{run.stderr[-6000:]}"
    )
