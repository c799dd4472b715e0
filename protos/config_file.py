"""Configuration files: the fields of a ``ShardingConfiguration`` written as JSON, TOML or YAML.

The file is one table whose keys are the configuration's fields (``client`` excepted: it comes
from the environment or the caller), e.g. ``sharding.toml``::

    job = "gpt-small"
    param_dtype = "bfloat16"
    gradient_accumulation_steps = 4

``ShardingConfiguration.from_file`` builds a configuration from it. ``paramshard launch
--config FILE`` hands the same file to every rank as ``PARAMSHARD_CONFIG`` (an absolute path),
which ``ShardingConfiguration.from_env`` reads as its base. The format is told by the suffix.

Torch-free, so the launcher reads the file before it starts anything: a file that cannot be
read or parsed stops the launch, not every rank.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["CONFIG_ENV", "FORMATS", "check_keys", "read_config_file"]

CONFIG_ENV = "PARAMSHARD_CONFIG"
"""The environment variable naming the config file ``ShardingConfiguration.from_env`` reads."""
FORMATS = {".json": "JSON", ".toml": "TOML", ".yaml": "YAML", ".yml": "YAML"}


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The table in ``path`` (format from its suffix). ``ValueError`` says what is wrong: an
    unknown suffix, a file that cannot be read, a syntax error, or a top level that is not a
    table."""
    name = os.fspath(path)
    suffix = os.path.splitext(name)[1].lower()
    kind = FORMATS.get(suffix)
    if kind is None:
        raise ValueError(
            f"config file {name}: cannot tell its format from the suffix {suffix or '(none)'!r};"
            f" use one of {', '.join(FORMATS)}"
        )
    try:
        with open(name, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read config file {name}: {exc.strerror}") from None
    try:
        values = _parse(kind, raw)
    except ImportError as exc:
        raise ValueError(f"config file {name}: {exc}") from None
    except Exception as exc:  # each parser has its own error class; all say where
        raise ValueError(f"config file {name} is not valid {kind}: {exc}") from None
    if values is None:  # an empty YAML file
        return {}
    if not isinstance(values, dict):
        raise ValueError(
            f"config file {name}: expected a table of field = value at the top level,"
            f" got a {type(values).__name__}"
        )
    return values


def check_keys(values: dict[str, Any], fields: Sequence[str], source: str) -> None:
    """Raises ``ValueError`` naming the first key of ``values`` that is not in ``fields``, the
    closest field, and all of them."""
    for key in values:
        if key in fields:
            continue
        close = difflib.get_close_matches(str(key), fields, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{source}: unknown key {key!r}{hint}; the valid keys are {', '.join(fields)}"
        )


def _parse(kind: str, raw: bytes) -> Any:
    if kind == "JSON":
        return json.loads(raw)
    if kind == "TOML":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10 (pyproject depends on tomli there)
            import tomli as tomllib
        return tomllib.loads(raw.decode("utf-8"))
    try:
        import yaml
    except ImportError:
        raise ImportError(
            "reading YAML needs PyYAML: pip install pyyaml (or write the file as JSON or TOML)"
        ) from None
    return yaml.safe_load(raw)
