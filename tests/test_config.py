"""ShardingConfiguration: validation, presets and from_env."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from paramshard.client.rpc import DEFAULT_TIMEOUT_S
from paramshard.strategies.config import ShardingConfiguration


@dataclasses.dataclass
class FakeClient:
    """Just what the configuration reads from a ShardClient."""

    rank: int = 0
    world_size: int = 1


def test_defaults() -> None:
    client = FakeClient(rank=1, world_size=4)
    config = ShardingConfiguration(client)
    assert config.client is client
    assert (config.rank, config.world_size) == (1, 4)
    assert config.auto_sync_gradients is True
    assert config.minimum_parameter_group_size == 1024
    assert config.enable_gradient_compression is False
    assert config.job == "default"
    assert config.bucket_size_bytes == 25 * 2**20
    # None: the parameters' own dtype class (float64 for float64 models, float32 otherwise)
    assert (config.param_dtype, config.reduce_dtype) == (None, None)
    assert config.effective_reduce_dtype is None
    assert config.deterministic is True  # rank-order reduction: bitwise reproducible runs
    assert config.reshard_after_forward and config.prefetch
    assert config.wrap_min_params is None
    assert config.timeout_s is None  # the client's own deadline (120 s unless it says)


def test_seed_fields_are_positional_the_rest_keyword_only() -> None:
    config = ShardingConfiguration(FakeClient(), False, 4096, True)
    assert not config.auto_sync_gradients
    assert config.minimum_parameter_group_size == 4096
    assert config.enable_gradient_compression
    with pytest.raises(TypeError):
        ShardingConfiguration(FakeClient(), True, 1024, False, "job")  # type: ignore[misc]


def test_frozen_and_replace_revalidates() -> None:
    config = ShardingConfiguration(FakeClient())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.job = "other"  # type: ignore[misc]
    assert dataclasses.replace(config, job="other").job == "other"
    with pytest.raises(ValueError, match="job"):
        dataclasses.replace(config, job="")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("auto_sync_gradients", "yes", r"auto_sync_gradients must be True or False"),
        ("enable_gradient_compression", 1, r"enable_gradient_compression must be True or"),
        ("reshard_after_forward", None, r"reshard_after_forward must be True or False"),
        ("prefetch", 0, r"prefetch must be True or False"),
        ("deterministic", 1, r"deterministic must be True or False"),
        ("minimum_parameter_group_size", -1, r"minimum_parameter_group_size must be an int"),
        ("minimum_parameter_group_size", 1.5, r"minimum_parameter_group_size must be an int"),
        ("bucket_size_bytes", 0, r"bucket_size_bytes must be an int >= 1"),
        ("bucket_size_bytes", True, r"bucket_size_bytes must be an int >= 1"),
        ("wrap_min_params", 0, r"wrap_min_params must be an int >= 1 or None"),
        ("job", "", r"job must be a non-empty name"),
        ("job", "my job", r"job must be .* got 'my job'"),
        ("job", "a/b", r"job must be"),
        ("param_dtype", "fp16", r"param_dtype must be one of float32, bfloat16, float16, float64"),
        ("reduce_dtype", "float8", r"reduce_dtype must be one of float32, .*float64 or None"),
        ("timeout_s", 0, r"timeout_s must be a positive finite number"),
        ("timeout_s", float("inf"), r"timeout_s must be a positive finite number"),
        ("timeout_s", "10", r"timeout_s must be a positive finite number"),
    ],
)
def test_validation_names_the_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=rf"ShardingConfiguration\.{message}"):
        ShardingConfiguration(FakeClient(), **{field: value})


def test_valid_values_pass() -> None:
    config = ShardingConfiguration(
        FakeClient(),
        job="gpt-small_v1.2",
        param_dtype="bfloat16",
        reduce_dtype="float16",
        wrap_min_params=10_000,
        timeout_s=5,
        minimum_parameter_group_size=0,
    )
    assert config.job == "gpt-small_v1.2" and config.effective_reduce_dtype == "float16"
    wide = ShardingConfiguration(FakeClient(), param_dtype="float64", reduce_dtype="float64")
    assert (wide.param_dtype, wide.reduce_dtype) == ("float64", "float64")


@pytest.mark.parametrize(
    ("param_dtype", "reduce_dtype", "compress", "model", "want"),
    [
        # defaults: each buffer's own class; float64 travels and is kept as float64
        (None, None, False, "float64", ("float64", "float64")),
        (None, None, False, "float32", ("float32", "float32")),
        (None, None, False, "bfloat16", ("float32", "float32")),  # float32 master class
        # mixed precision asked for
        ("bfloat16", None, False, "float32", ("bfloat16", "bfloat16")),  # FSDP2: compute dtype
        ("bfloat16", "float32", False, "float32", ("bfloat16", "float32")),
        ("bfloat16", "float16", False, "float64", ("bfloat16", "float16")),
        # compression: bfloat16 on the wire, unless a 16-bit type is named
        (None, None, True, "float64", ("float64", "bfloat16")),
        (None, "float16", True, "float32", ("float32", "float16")),
        # nothing wider than the class: float64 asked of float32 parameters is float32
        ("float64", "float64", False, "float32", ("float32", "float32")),
        ("float64", "float64", False, "float64", ("float64", "float64")),
    ],
)
def test_dtypes_resolve_per_buffer(param_dtype, reduce_dtype, compress, model, want) -> None:
    config = ShardingConfiguration(
        FakeClient(),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        enable_gradient_compression=compress,
    )
    assert (config.param_dtype_for(model), config.reduce_dtype_for(model)) == want


def test_master_dtype_is_float64_only_for_float64() -> None:
    from paramshard.strategies.config import master_dtype

    assert master_dtype("float64") == master_dtype("torch.float64") == "float64"
    for other in ("float32", "bfloat16", "float16", "torch.float32"):
        assert master_dtype(other) == "float32"


@pytest.mark.parametrize(
    ("client", "message"),
    [
        (None, r"client is required"),
        (FakeClient(rank=2, world_size=2), r"client\.rank must be an int in 0\.\.1, got 2"),
        (FakeClient(rank=-1, world_size=2), r"client\.rank"),
        (FakeClient(rank=0, world_size=0), r"client\.world_size must be an int >= 1"),
        (object(), r"client\.world_size"),
    ],
)
def test_bad_client(client: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardingConfiguration(client)


def test_compression_means_bfloat16_on_the_wire() -> None:
    config = ShardingConfiguration(FakeClient(), enable_gradient_compression=True)
    assert config.reduce_dtype is None
    assert config.effective_reduce_dtype == "bfloat16"
    off = dataclasses.replace(config, enable_gradient_compression=False)
    assert off.effective_reduce_dtype is None  # the parameters' own again


def test_presets() -> None:
    client = FakeClient(rank=0, world_size=2)
    default = ShardingConfiguration.create_default(client)
    assert default == ShardingConfiguration(client)

    high = ShardingConfiguration.create_for_high_bandwidth(client)
    assert high.bucket_size_bytes > default.bucket_size_bytes
    assert not high.enable_gradient_compression and not high.reshard_after_forward
    assert high.effective_reduce_dtype is None  # full precision: the parameters' own

    low = ShardingConfiguration.create_for_low_bandwidth(client)
    assert low.enable_gradient_compression and low.effective_reduce_dtype == "bfloat16"
    assert low.bucket_size_bytes < default.bucket_size_bytes
    assert low.timeout_s > DEFAULT_TIMEOUT_S  # longer than a client's own deadline
    assert client.timeout_s == low.timeout_s  # the configuration sets the client's deadline

    custom = ShardingConfiguration.create_for_low_bandwidth(client, job="j", timeout_s=30.0)
    assert (custom.job, custom.timeout_s, custom.enable_gradient_compression) == ("j", 30.0, True)
    with pytest.raises(ValueError, match="bucket_size_bytes"):
        ShardingConfiguration.create_for_high_bandwidth(client, bucket_size_bytes=-5)


# --- from_env: needs the real client package, which is written alongside -------------------


@pytest.fixture
def client_module() -> Any:
    try:
        from paramshard import client
        from paramshard.client import ClusterSpec, ShardClient, from_env  # noqa: F401
    except ImportError as err:
        pytest.skip(f"client package not available yet ({err}); from_env cannot be tested")
    return client


def test_from_env_reads_rank_and_world_size(
    client_module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: dict[str, Any] = {}

    class FakeSpec:
        @classmethod
        def from_env(cls) -> FakeSpec:
            return cls()

    class RecordingClient(FakeClient):
        closed = False

        def __init__(self, spec: Any, *, rank: int, world_size: int, run_id: str) -> None:
            super().__init__(rank=rank, world_size=world_size)
            made["spec"], made["run_id"] = spec, run_id

    monkeypatch.setattr(client_module.from_env, "ClusterSpec", FakeSpec)
    monkeypatch.setattr(client_module.from_env, "ShardClient", RecordingClient)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.delenv("PARAMSHARD_RUN", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    config = ShardingConfiguration.from_env(job="env-job")
    assert (config.rank, config.world_size, config.job) == (2, 3, "env-job")
    assert isinstance(made["spec"], FakeSpec)
    assert made["run_id"] == "env-job"  # no run named: the job's (client/run_id.py)

    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert (ShardingConfiguration.from_env().rank, ShardingConfiguration.from_env().world_size) == (
        0,
        1,
    )

    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK must be an integer, got 'zero'"):
        ShardingConfiguration.from_env()


def test_from_env_without_servers_says_so(
    client_module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PARAMSHARD_SERVERS", raising=False)
    with pytest.raises(Exception, match="PARAMSHARD_SERVERS"):
        ShardingConfiguration.from_env()
