"""One import name, kept so (issue 25): the wheel installs ``paramshard`` alone, with the wire
contract (``shard.proto``) inside; pyproject's hand-written package list matches the folders; a
user's folder holding ``client.py``, ``server.py``, ``protos.py``, ``strategies.py`` and an
``examples/`` package changes nothing for ``LocalCluster``, ``paramshard launch`` or
``paramshard serve``; ``import paramshard`` stays cheap.

The bare names of the folders are checked in tests/test_bare_names.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pyproject's dependency for Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
FOLDER_NAMES = ("client", "server", "protos", "strategies")
"""The repository's top-level folders that install under ``paramshard``: the names a user's
project is most likely to hold as well."""
TIMEOUT_S = 300


# ---------------------------------------------------------------------------- the package list
def package_folder(package: str) -> Path:
    """Where setuptools takes ``package`` from: the longest ``package-dir`` prefix, else the
    package's own path (setuptools' rule)."""
    mapping: dict[str, str] = SETUPTOOLS.get("package-dir", {})
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in mapping:
            return ROOT / mapping[prefix] / Path(*parts[cut:])
    return ROOT / Path(*parts)


def packages_on_disk() -> dict[str, Path]:
    """Every package under the folders pyproject maps (its own names, the package-dir keys):
    each folder below them that holds ``__init__.py``, by the name it installs as."""
    roots = {name.split(".")[0] for name in SETUPTOOLS["packages"]}
    roots |= set(SETUPTOOLS.get("package-dir", {}))
    found: dict[str, Path] = {}
    for root in sorted(roots):
        top = package_folder(root)
        for init in top.rglob("__init__.py"):
            rel = init.parent.relative_to(top)
            found[".".join([root, *rel.parts])] = init.parent
    return found


def test_package_list_matches_the_folders() -> None:
    """A subpackage missing from ``[tool.setuptools] packages`` still imports in an editable
    install (its parent's folder is on the path) but is absent from the wheel."""
    listed = set(SETUPTOOLS["packages"])
    on_disk = packages_on_disk()
    assert "paramshard.server" in on_disk and "paramshard.protos" in on_disk, sorted(on_disk)
    missing = sorted(set(on_disk) - listed)
    assert not missing, (
        f"pyproject.toml [tool.setuptools] packages lacks {missing} "
        f"({', '.join(str(on_disk[m].relative_to(ROOT)) for m in missing)} hold __init__.py)"
    )
    stale = sorted(listed - set(on_disk))
    assert not stale, f"pyproject.toml lists {stale}, but no folder with __init__.py is there"


def test_every_folder_of_modules_is_a_package() -> None:
    """A folder of modules without ``__init__.py`` would import as a namespace package from the
    repository and be left out of the wheel."""
    for name, folder in packages_on_disk().items():
        for sub in folder.iterdir():
            if sub.is_dir() and any(sub.glob("*.py")):
                assert (sub / "__init__.py").is_file(), (
                    f"{sub.relative_to(ROOT)} holds modules but no __init__.py, so "
                    f"{name}.{sub.name} is not installed"
                )


# ----------------------------------------------------------------------------------- the wheel
def _copy_source(dest: Path) -> Path:
    """The project's files without the virtualenv, git and build leftovers, so the wheel is
    built as from a fresh clone and the checkout is left as it was."""
    skip = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
    )
    shutil.copytree(ROOT, dest, ignore=skip)
    return dest


@pytest.mark.slow
def test_wheel_installs_paramshard_alone_with_the_wire_contract(tmp_path: Path) -> None:
    source = _copy_source(tmp_path / "src")
    out = tmp_path / "wheel"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = out.glob("paramshard-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        top_level = zf.read(f"{info}/top_level.txt").decode().split()
    tops = {n.split("/")[0] for n in names} - {info}
    assert tops == {"paramshard"}, f"the wheel installs {sorted(tops)} at the top level"
    assert top_level == ["paramshard"], top_level
    assert "paramshard/protos/shard.proto" in names, "shard.proto, the wire contract, is missing"
    # Every module of every package folder is in the wheel, under its installed name.
    expected = {
        f"{name.replace('.', '/')}/{py.name}"
        for name, folder in packages_on_disk().items()
        for py in folder.glob("*.py")
    }
    assert expected <= set(names), f"missing from the wheel: {sorted(expected - set(names))}"
    assert "paramshard/models/gpt.py" in expected


# ------------------------------------------------------------------ a user's folder with clashes
TRAIN = """\
import copy, json, sys
from pathlib import Path

import torch

from paramshard import {imports}
from paramshard.models.gpt import GPT, Block, GPTConfig, lm_loss

torch.set_num_threads(1)
torch.manual_seed(0)  # thread ranks share torch's RNG: draw the model and batch once, here
TEMPLATE = GPT(GPTConfig.tiny())
X = torch.randint(0, 128, (4, 16))
Y = torch.roll(X, -1, dims=1)


def train(config):
    # The same model and batch on every rank, so every rank's losses must agree.
    model = FSDPModel(copy.deepcopy(TEMPLATE), config, wrap=(Block,))
    opt = FSDPOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    losses = []
    for _ in range(3):
        loss = lm_loss(model(X), Y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def loaded_from_here():
    \"\"\"The modules this process took from the user's folder, other than the script.\"\"\"
    here = Path.cwd().resolve()
    script = Path(sys.argv[0]).resolve()
    files = {{name: getattr(m, "__file__", None) for name, m in list(sys.modules.items())}}
    return sorted(
        name for name, file in files.items()
        if file and Path(file).is_absolute() and Path(file).resolve() != script
        and Path(file).resolve().is_relative_to(here)
    )
"""

LOCAL_CLUSTER = """
with LocalCluster(world_size=2, job="clashes") as cluster:
    results = cluster.run(train)
print("RESULT", json.dumps({"losses": results, "from_here": loaded_from_here()}))
"""

LAUNCHED = """
losses = train(ShardingConfiguration.from_env(job="clashes"))
print("RESULT", json.dumps({"losses": losses, "from_here": loaded_from_here()}))
"""


def user_folder(path: Path) -> Path:
    """A user's project folder whose modules share paramshard's folder names: each one raises if
    imported, or, for ``strategies.py``, defines a ``ShardingConfiguration`` of its own."""
    path.mkdir()
    for name in FOLDER_NAMES:
        (path / f"{name}.py").write_text(
            f"raise ImportError('the user\\'s {name}.py was imported instead of paramshard\\'s')\n"
        )
    (path / "strategies.py").write_text(
        "ShardingConfiguration = FSDPModel = None  # the user's own, not paramshard's\n"
    )
    (path / "examples").mkdir()
    (path / "examples" / "__init__.py").write_text(
        "raise ImportError('the user\\'s examples package was imported')\n"
    )
    return path


def paramshard_command() -> str:
    """The console script, as a user runs it (``python -m`` would add the folder to sys.path)."""
    script = Path(sys.executable).with_name("paramshard")
    assert script.is_file(), f"{script}: no paramshard console script beside this interpreter"
    return str(script)


def _result(stdout: str) -> list[dict]:
    return [
        json.loads(line.split("RESULT ", 1)[1]) for line in stdout.splitlines() if "RESULT " in line
    ]


def _check_training(losses: list[list[float]], from_here: list[str]) -> None:
    assert from_here == [], f"modules loaded from the user's folder: {from_here}"
    assert len(losses) == 2 and losses[0] == losses[1], losses  # one batch, one model, 2 ranks
    assert losses[0][-1] < losses[0][0], f"3 steps on one batch did not lower the loss: {losses}"


@pytest.mark.slow
def test_local_cluster_trains_beside_clashing_files(tmp_path: Path) -> None:
    folder = user_folder(tmp_path / "project")
    imports = "FSDPModel, FSDPOptimizer, LocalCluster"
    (folder / "train_local.py").write_text(TRAIN.format(imports=imports) + LOCAL_CLUSTER)
    run = subprocess.run(
        [sys.executable, "train_local.py"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (result,) = _result(run.stdout)
    _check_training(result["losses"], result["from_here"])


@pytest.mark.slow
def test_launch_trains_beside_clashing_files(tmp_path: Path) -> None:
    folder = user_folder(tmp_path / "project")
    imports = "FSDPModel, FSDPOptimizer, ShardingConfiguration"
    (folder / "train.py").write_text(TRAIN.format(imports=imports) + LAUNCHED)
    run = subprocess.run(
        [paramshard_command(), "launch", "--nproc", "2", "train.py"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    results = _result(run.stdout)
    assert len(results) == 2, run.stdout + run.stderr
    assert "started 2 shard servers" in run.stderr, run.stderr
    _check_training([r["losses"] for r in results], [m for r in results for m in r["from_here"]])


@pytest.mark.slow
def test_serve_from_a_folder_with_clashing_files(tmp_path: Path) -> None:
    """``paramshard serve`` re-executes itself to set glibc's MALLOC_* settings: the new
    interpreter must not import the folder's files either, not even a ``paramshard.py`` or a
    module named like the standard library's."""
    import numpy as np

    from paramshard.client import ClusterSpec, ShardClient
    from paramshard.server.app import MALLOC_ENV

    folder = user_folder(tmp_path / "project")
    for name in ("paramshard", "logging", "grpc"):
        (folder / f"{name}.py").write_text(f"raise ImportError('the user\\'s {name}.py')\n")
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}  # so it re-executes
    proc = subprocess.Popen(
        [paramshard_command(), "serve", "--port", "0"],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    listening = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "listening on" in line:
                listening.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert listening.wait(60), "".join(lines)
        address = next(ln for ln in lines if "listening on" in ln).split("listening on ")[1]
        address = address.split()[0]
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert b"MALLOC_ARENA_MAX=1" in environ, "serve did not re-execute with MALLOC_* set"
        health = subprocess.run(
            [paramshard_command(), "health", address],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert health.returncode == 0, health.stdout + health.stderr
        client = ShardClient(ClusterSpec([address]), timeout_s=30)
        try:
            summed = client.all_reduce(np.arange(4, dtype=np.float32))
        finally:
            client.close()
        np.testing.assert_array_equal(summed, np.arange(4, dtype=np.float32))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "".join(lines)
        reader.join(10)
        assert any("stopped" in ln for ln in lines), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


# ---------------------------------------------------------------------------- import paramshard
@pytest.mark.slow
def test_import_paramshard_is_cheap_and_every_name_resolves(tmp_path: Path) -> None:
    code = (
        "import sys, paramshard\n"
        "heavy = sorted({'grpc', 'numpy', 'torch'} & set(sys.modules))\n"
        "assert not heavy, f'import paramshard loaded {heavy}'\n"
        "missing = [n for n in paramshard.__all__ if getattr(paramshard, n, None) is None]\n"
        "assert not missing, f'paramshard.__all__ names that do not resolve: {missing}'\n"
        "assert set(paramshard.__all__) <= set(dir(paramshard))\n"
        "from paramshard import FSDPModel, ShardingConfiguration, LocalCluster\n"
        "from paramshard.strategies import FSDPModel as home\n"
        "assert FSDPModel is home\n"
        "from importlib.metadata import version\n"
        "assert paramshard.__version__ == version('paramshard')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,  # not the checkout: the installed package, as a user imports it
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert run.returncode == 0, run.stderr
