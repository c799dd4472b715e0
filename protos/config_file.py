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
import functools
import json
import os
import reprlib
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["CONFIG_ENV", "FORMATS", "MAX_CONFIG_BYTES", "check_keys", "read_config_file", "shown"]

CONFIG_ENV = "PARAMSHARD_CONFIG"
"""The environment variable naming the config file ``ShardingConfiguration.from_env`` reads."""
FORMATS = {".json": "JSON", ".toml": "TOML", ".yaml": "YAML", ".yml": "YAML"}
MAX_CONFIG_BYTES = 2**20
"""A config file holds a few dozen settings; a larger one is refused before it is parsed."""
SHOWN_CHARS = 80
"""An error message echoes at most this many characters of a value (``shown``)."""
_MESSAGE_CHARS = 500  # a parser's own message, which may quote the file, is cut here


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters: a value read from a
    file or the environment may be any size, and a message must not grow with it. A
    container's repr is built only as far as it is shown, so a huge value costs no more than
    a small one."""
    text = reprlib.Repr()
    text.maxstring = text.maxother = text.maxlong = limit
    text.maxlevel, text.maxlist, text.maxdict, text.maxtuple, text.maxset = 3, 8, 8, 8, 8
    try:
        out = text.repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        out = f"<a {type(value).__name__} too large to show>"
    return out if len(out) <= limit else out[: limit - 3] + "..."


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
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read config file {name}: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(
            f"config file {name} is larger than {MAX_CONFIG_BYTES:,} bytes; a config file"
            " holds a few settings"
        )
    try:
        values = _parse(kind, raw)
    except ImportError as exc:
        raise ValueError(f"config file {name}: {exc}") from None
    except Exception as exc:  # each parser has its own error class; all say where
        why = str(exc)
        if len(why) > _MESSAGE_CHARS:
            why = why[: _MESSAGE_CHARS - 3] + "..."
        raise ValueError(f"config file {name} is not valid {kind}: {why}") from None
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
        close = difflib.get_close_matches(str(key)[:SHOWN_CHARS], fields, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{source}: unknown key {shown(key)}{hint}; the valid keys are {', '.join(fields)}"
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
    return yaml.load(raw, Loader=_no_aliases_loader())  # noqa: S506 - a SafeLoader, aliases refused


@functools.cache
def _no_aliases_loader() -> type:
    """PyYAML's SafeLoader (no object tags) that refuses aliases: ``*name`` repeats a node
    without copying it, so a few hundred bytes of nested aliases expand to millions of values
    (a "billion laughs"); a config file has no use for them."""
    import yaml

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None, None, f"an alias (*{event.anchor[:SHOWN_CHARS]}) is not allowed in a"
                    " config file; write the value out", event.start_mark,
                )  # fmt: skip
            return super().compose_node(parent, index)

    return NoAliases
