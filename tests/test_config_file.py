"""``ShardingConfiguration.from_file`` and ``from_env`` with ``PARAMSHARD_CONFIG``: JSON, TOML and
YAML files whose keys are the configuration's fields; the constructor's checks and messages."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

import paramshard.client.from_env as client_package
from paramshard.protos.config_file import CONFIG_ENV, read_config_file
from paramshard.strategies.config import ShardingConfiguration


@dataclasses.dataclass
class FakeClient:
    """Just what the configuration reads from a ShardClient."""

    rank: int = 0
    world_size: int = 1


SETTINGS = {
    "job": "from-file",
    "param_dtype": "bfloat16",
    "gradient_accumulation_steps": 4,
    "timeout_s": 30.5,
    "reshard_after_forward": False,
}
TOML = """\
# a ShardingConfiguration
job = "from-file"
param_dtype = "bfloat16"
gradient_accumulation_steps = 4
timeout_s = 30.5
reshard_after_forward = false
"""
YAML = """\
job: from-file
param_dtype: bfloat16
gradient_accumulation_steps: 4
timeout_s: 30.5
reshard_after_forward: false
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("name", "text"),
    [("c.json", json.dumps(SETTINGS)), ("c.toml", TOML), ("c.yaml", YAML), ("c.YML", YAML)],
)
def test_each_format_gives_the_same_configuration(tmp_path: Path, name: str, text: str) -> None:
    client = FakeClient(rank=1, world_size=2)
    config = ShardingConfiguration.from_file(write(tmp_path, name, text), client)
    assert config == ShardingConfiguration(client, **SETTINGS)
    assert config.client is client
    assert config.bucket_size_bytes == 25 * 2**20  # not in the file: the default


def test_keyword_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "c.toml", TOML)
    config = ShardingConfiguration.from_file(path, FakeClient(), job="override", timeout_s=5.0)
    assert (config.job, config.timeout_s, config.param_dtype) == ("override", 5.0, "bfloat16")
    # a bad value in the file that an override replaces is never seen
    bad = write(tmp_path, "bad.json", json.dumps({"timeout_s": -1}))
    assert ShardingConfiguration.from_file(bad, FakeClient(), timeout_s=1.0).timeout_s == 1.0


def test_json_null_is_none(tmp_path: Path) -> None:
    path = write(tmp_path, "c.json", '{"param_dtype": null, "wrap_min_params": null}')
    config = ShardingConfiguration.from_file(path, FakeClient())
    assert (config.param_dtype, config.wrap_min_params) == (None, None)


def test_unknown_key_is_named_with_the_valid_ones(tmp_path: Path) -> None:
    path = write(tmp_path, "c.toml", 'job = "j"\nbucket_size = 1024\n')
    with pytest.raises(ValueError) as err:
        ShardingConfiguration.from_file(path, FakeClient())
    message = str(err.value)
    assert f"config file {path}: unknown key 'bucket_size'" in message
    assert "did you mean 'bucket_size_bytes'?" in message
    for field in dataclasses.fields(ShardingConfiguration):
        assert (field.name in message) == (field.name != "client"), field.name


def test_client_is_not_a_file_key(tmp_path: Path) -> None:
    path = write(tmp_path, "c.json", '{"client": "h:1"}')
    with pytest.raises(ValueError, match="unknown key 'client'"):
        ShardingConfiguration.from_file(path, FakeClient())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('param_dtype = "fp8"\n', "ShardingConfiguration.param_dtype must be one of float32, "),
        ('auto_sync_gradients = "yes"\n', "auto_sync_gradients must be True or False, got 'yes'"),
        ("gradient_accumulation_steps = 0\n", "gradient_accumulation_steps must be an int >= 1"),
        ("bucket_size_bytes = 1.5\n", "bucket_size_bytes must be an int >= 1, got 1.5"),
        ('job = "a b"\n', "ShardingConfiguration.job must be a non-empty name"),
    ],
)
def test_bad_values_get_the_constructors_message_and_the_file(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, "c.toml", text)
    with pytest.raises(ValueError) as err:
        ShardingConfiguration.from_file(path, FakeClient())
    assert message in str(err.value)
    assert str(err.value).endswith(f"(in config file {path})")


def test_a_bad_override_is_not_blamed_on_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "c.toml", TOML)
    with pytest.raises(ValueError) as err:
        ShardingConfiguration.from_file(path, FakeClient(), job="")
    assert "ShardingConfiguration.job" in str(err.value)
    assert "config file" not in str(err.value)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("c.ini", "job = x", "cannot tell its format from the suffix '.ini'; use one of .json"),
        ("c", "{}", "from the suffix '(none)'"),
        ("c.json", '{"job": "x",}', "is not valid JSON: "),
        ("c.toml", "job = ", "is not valid TOML: "),
        ("c.yaml", "job: [x", "is not valid YAML: "),
        ("c.json", '["job"]', "expected a table of field = value at the top level, got a list"),
    ],
)
def test_unreadable_files(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ValueError, match="config file") as err:
        ShardingConfiguration.from_file(path, FakeClient())
    assert message in str(err.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read config file .*nope\.toml: No such file"):
        ShardingConfiguration.from_file(tmp_path / "nope.toml", FakeClient())


def test_empty_yaml_is_the_defaults(tmp_path: Path) -> None:
    config = ShardingConfiguration.from_file(write(tmp_path, "c.yaml", ""), FakeClient())
    assert config == ShardingConfiguration(config.client)


def test_yaml_without_pyyaml_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    with pytest.raises(ValueError, match=r"reading YAML needs PyYAML: pip install pyyaml"):
        read_config_file(write(tmp_path, "c.yaml", YAML))
    assert read_config_file(write(tmp_path, "c.toml", TOML)) == SETTINGS  # others still read


# --- the client from the environment ---------------------------------------------------------
@pytest.fixture
def env_client(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """ClusterSpec/ShardClient replaced by recorders; returns the clients made."""
    made: list[Any] = []

    class FakeSpec:
        @classmethod
        def from_env(cls) -> FakeSpec:
            return cls()

    class RecordingClient(FakeClient):
        closed = False

        def __init__(self, spec: Any, *, rank: int, world_size: int, run_id: str) -> None:
            super().__init__(rank=rank, world_size=world_size)
            self.run_id = run_id
            made.append(self)

    monkeypatch.setattr(client_package, "ClusterSpec", FakeSpec)
    monkeypatch.setattr(client_package, "ShardClient", RecordingClient)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    return made


def test_from_file_without_a_client_reads_the_environment(
    tmp_path: Path, env_client: list[Any]
) -> None:
    config = ShardingConfiguration.from_file(write(tmp_path, "c.toml", TOML))
    assert config.client is env_client[0]
    assert (config.rank, config.world_size, config.job) == (1, 3, "from-file")


def test_configurations_from_the_environment_share_its_client_until_it_is_closed(
    env_client: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two models' configurations in one script number their collectives on one client
    (client/from_env.py); a closed client is not handed out again."""
    monkeypatch.setenv("PARAMSHARD_RUN", "one-run")  # as the launcher sets it
    first = ShardingConfiguration.from_env(job="generator")
    second = ShardingConfiguration.from_env(job="discriminator")
    assert second.client is first.client and len(env_client) == 1
    first.client.closed = True
    assert ShardingConfiguration.from_env(job="again").client is not first.client


def test_from_env_reads_paramshard_config_as_its_base(
    tmp_path: Path, env_client: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ShardingConfiguration.from_env().job == "default"  # no PARAMSHARD_CONFIG: defaults
    monkeypatch.setenv(CONFIG_ENV, str(write(tmp_path, "c.yaml", YAML)))
    config = ShardingConfiguration.from_env(timeout_s=7.0)
    assert (config.rank, config.world_size) == (1, 3)
    assert (config.job, config.param_dtype, config.gradient_accumulation_steps) == (
        "from-file",
        "bfloat16",
        4,
    )
    assert config.timeout_s == 7.0  # keyword arguments > the file > the defaults

    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "gone.json"))
    with pytest.raises(ValueError, match="cannot read config file .*gone.json"):
        ShardingConfiguration.from_env()
