"""Config files a caller cannot turn into a memory bomb (issue 27, finding 7;
protos/config_file.py, strategies/config.py).

A 234-byte YAML file of 7 nested aliases expands to 9**7 values; before, ``safe_load`` expanded
them and ``ShardingConfiguration.from_file`` put the expanded value (tens of millions of
characters) into its error message. Aliases are refused now, and every message that echoes a
value cuts it.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from paramshard.protos import config_file
from paramshard.protos.config_file import read_config_file
from paramshard.strategies.config import ShardingConfiguration
from paramshard.strategies.config import ShardingConfiguration as Config

MESSAGE_BOUND = 1000  # characters: the longest message here names a file and lists the fields


class Rank:
    rank, world_size = 0, 1


def alias_bomb(levels: int = 7) -> str:
    """``timeout_s: [&a [x * 9], &b [*a * 9], ...]``: 9**levels strings from ~230 bytes."""
    parts = ["&a [x,x,x,x,x,x,x,x,x]"]
    names = "abcdefghij"
    for name, prev in zip(names[1:levels], names[: levels - 1], strict=True):
        parts.append(f"&{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "timeout_s: [" + ", ".join(parts) + "]\n"


def from_file(path: Path) -> str:
    """The message of the ValueError ``from_file`` raises, and its peak allocation bounded."""
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as err:
            ShardingConfiguration.from_file(path, client=Rank())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert len(message) < MESSAGE_BOUND, f"{len(message):,} characters: {message[:200]}..."
    assert peak < 16 * 2**20, f"reading {path.name} allocated {peak:,} bytes"
    return message


def test_yaml_aliases_are_refused_before_they_expand(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert path.stat().st_size < 300
    message = from_file(path)
    assert "alias (*a) is not allowed" in message and str(path) in message, message
    # a merge key is an alias too; an anchor alone expands nothing and stays allowed
    merged = tmp_path / "merge.yaml"
    merged.write_text("job: &j one\nparam_dtype: bfloat16\nreduce_dtype: *j\n")
    assert "alias (*j) is not allowed" in from_file(merged)
    anchored = tmp_path / "anchor.yaml"
    anchored.write_text("job: &j one\ntimeout_s: 3\n")
    assert read_config_file(anchored) == {"job": "one", "timeout_s": 3}


@pytest.mark.parametrize(
    ("name", "values", "words"),
    [
        ("job.json", {"job": "j/" * 2**15}, "ShardingConfiguration.job must be"),
        ("timeout.json", {"timeout_s": [list(range(50))] * 2000}, "timeout_s must be"),
        ("flag.json", {"prefetch": "y" * 2**16}, "prefetch must be True or False"),
        ("size.json", {"bucket_size_bytes": "9" * 2**16}, "bucket_size_bytes must be"),
        ("dtype.json", {"param_dtype": "f" * 2**16}, "param_dtype must be one of"),
        ("key.json", {"k" * 2**16: 1}, "unknown key"),
    ],
)
def test_messages_echo_at_most_a_cut_value(tmp_path: Path, name, values, words) -> None:
    path = tmp_path / name
    path.write_text(json.dumps(values))
    message = from_file(path)
    assert words in message and "..." in message, message


def test_a_huge_config_file_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "huge.json"
    path.write_text('{"job": "' + "j" * config_file.MAX_CONFIG_BYTES + '"}')
    message = from_file(path)
    assert f"larger than {config_file.MAX_CONFIG_BYTES:,} bytes" in message, message


def test_values_from_the_environment_are_cut_too(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "7" * 2**20 + "x")
    monkeypatch.setenv("PARAMSHARD_SERVERS", "127.0.0.1:1")
    monkeypatch.delenv("PARAMSHARD_CONFIG", raising=False)
    with pytest.raises(ValueError) as err:
        Config.from_env()
    assert len(str(err.value)) < MESSAGE_BOUND and "RANK must be an integer" in str(err.value)
