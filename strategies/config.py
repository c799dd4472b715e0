"""ShardingConfiguration: every knob of a sharded training run, validated once at construction.

The first four fields keep AiDotNet's names and order (``client``, ``auto_sync_gradients``,
``minimum_parameter_group_size``, ``enable_gradient_compression``) so code written against the
seeds still works, positionally too; everything after them is keyword-only. The dataclass is
frozen: a configuration that was valid when built stays valid, and
``dataclasses.replace(config, ...)`` re-runs the checks.

This module is pure logic: dtypes are names, not torch dtypes, and the client is only used
for its ``rank`` and ``world_size``.

Dtypes follow FSDP2's ``MixedPrecisionPolicy``: ``param_dtype`` / ``reduce_dtype`` None means
"the parameters' own dtype class". A buffer's *master dtype* (``master_dtype``) is float64 for
float64 parameters and float32 for every other floating dtype; the servers keep the master
copy and optimizer state in it. ``param_dtype_for`` / ``reduce_dtype_for`` resolve the two
fields for one buffer: the only place strategies read them.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import KW_ONLY, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, get_args

from paramshard.protos.codec import master_dtype
from paramshard.protos.config_file import CONFIG_ENV, check_keys, read_config_file, shown

if TYPE_CHECKING:
    from paramshard.client import ShardClient

__all__ = ["ShardingConfiguration", "DType", "MasterDType", "master_dtype"]

DType = Literal["float32", "bfloat16", "float16", "float64"]
MasterDType = Literal["float32", "float64"]
_DTYPES: tuple[str, ...] = get_args(DType)
_HALF = ("bfloat16", "float16")
_JOB_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_DEFAULT_JOB = "default"


class ClientRank:
    """``rank`` and ``world_size`` of whatever holds a ``client`` (a configuration, a model)."""

    client: Any

    @property
    def rank(self) -> int:
        """This process's rank, from the client."""
        return self.client.rank

    @property
    def world_size(self) -> int:
        """Number of training processes, from the client."""
        return self.client.world_size


@dataclass(frozen=True)
class ShardingConfiguration(ClientRank):
    """How a model is sharded over the servers and how its gradients travel."""

    client: ShardClient
    """Connection to the shard servers; also says which rank this process is."""
    auto_sync_gradients: bool = True
    """Synchronise gradients automatically during backward/step (False: call sync yourself)."""
    minimum_parameter_group_size: int = 1024
    """Modules with fewer parameters than this are not gathered as a unit of their own."""
    enable_gradient_compression: bool = False
    """Send gradients as bfloat16, halving gradient traffic (see ``effective_reduce_dtype``)."""
    _: KW_ONLY
    job: str = _DEFAULT_JOB
    """Name of the training job on the servers; letters, digits, '_', '.', '-'."""
    bucket_size_bytes: int = 25 * 2**20
    """Gradient bucket size for DDP / ZeRO-2, like torch DDP's bucket_cap_mb (25 MiB)."""
    gradient_as_bucket_view: bool = False
    """DDP: each gradient becomes a view of its bucket's flat buffer, which the all-reduce
    averages in place (torch DDP's ``gradient_as_bucket_view``): no copy back, and no
    gradient held twice once copied in (GPT-2 124M: 100-150 MB lower trainer peak, which is
    in backward; docs/benchmarks.md). A ``p.grad`` the caller kept then changes with the next
    step's gradients. False (torch's default): the averages are copied back into each
    parameter's own gradient."""
    param_dtype: DType | None = None
    """Dtype forward and backward compute in (FSDP2's ``MixedPrecisionPolicy.param_dtype``;
    the servers keep the float32 master; strategies/mixed_precision.py); None: the
    parameters' own dtype."""
    reduce_dtype: DType | None = None
    """Dtype gradients leave the trainer in; None: ``param_dtype`` when set (as FSDP2), else
    the parameters' own dtype class (float64 for float64 parameters, float32 otherwise)."""
    deterministic: bool = True
    """Reduce contributions in rank order (micro-batch order within a rank) whatever order
    they arrive in, so two runs give bitwise identical results; False sums in arrival order
    and needs no staging memory on the servers."""
    reshard_after_forward: bool = True
    """FSDP: free a unit's gathered parameters after its forward, gather again for backward."""
    prefetch: bool = True
    """FSDP: gather the next unit while this one computes."""
    wrap_min_params: int | None = None
    """FSDP size-based wrap policy threshold; None wraps by module class only."""
    timeout_s: float | None = None
    """Deadline in seconds of every wait of this rank on the servers and on the other ranks
    (a collective, a gradient step, a pull at a version, a pipeline receive, a barrier),
    retries included: the client's ``timeout_s`` is set to it. None: the client's own
    (``ShardClient(timeout_s=...)``, 120 s unless given)."""
    replicate_every: int = 0
    """Neighbour replication: every this many steps each server copies its slices and
    optimizer state to server (i+1) mod N, so a dead server is rebuilt from it (0: off)."""
    gradient_accumulation_steps: int = 1
    """ZeRO-2 / FSDP: backward passes per optimizer step; each micro-batch's gradients are
    pushed during its backward and summed on the servers, which must know how many to expect."""
    skip_nonfinite: bool = False
    """A step whose reduced gradient holds NaN or Inf is skipped everywhere either way
    (parameters and optimizer state unchanged); True counts it (``model.skipped_steps``) and
    trains on, as ``torch.amp.GradScaler`` does, False raises ``NonFiniteGradientError``."""
    elastic: bool = False
    """ZeRO-1/2, FSDP: the data-parallel ranks may change between steps (docs/elastic.md): each
    step's members are agreed on the servers, ``model.batch_part(B)`` cuts the step's global
    batch between them, and the servers weight each gradient by its share. The client's
    ``world_size`` is then the most ranks the job may have. ``PARAMSHARD_ELASTIC=1``
    (``paramshard launch --elastic``) sets it in ``from_env``."""
    min_world_size: int = 1
    """Elastic: a step trains with at least this many ranks; below it the ranks wait
    (``elastic_wait_s``), then fail naming the ranks there (``PARAMSHARD_MIN_NPROC``,
    ``paramshard launch --min-nproc``)."""
    join_window_s: float = 10.0
    """Elastic: how long a step waits for the ranks of the step before it once the first of
    them is there; a rank later than that sits the step out and joins the next."""
    elastic_wait_s: float = 600.0
    """Elastic: how long a step waits for ``min_world_size`` ranks before it fails."""

    def __post_init__(self) -> None:
        self._check_client()
        for name in (
            "auto_sync_gradients",
            "enable_gradient_compression",
            "reshard_after_forward",
            "prefetch",
            "deterministic",
            "gradient_as_bucket_view",
            "skip_nonfinite",
            "elastic",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(
                    f"ShardingConfiguration.{name} must be True or False, got {shown(value)}"
                )
        _check_int("minimum_parameter_group_size", self.minimum_parameter_group_size, minimum=0)
        _check_int("bucket_size_bytes", self.bucket_size_bytes, minimum=1)
        _check_int("gradient_accumulation_steps", self.gradient_accumulation_steps, minimum=1)
        _check_int("replicate_every", self.replicate_every, minimum=0)
        _check_int("min_world_size", self.min_world_size, minimum=1)
        if self.wrap_min_params is not None:
            _check_int("wrap_min_params", self.wrap_min_params, minimum=1, none_ok=True)
        if not isinstance(self.job, str) or not _JOB_NAME.fullmatch(self.job):
            raise ValueError(
                f"ShardingConfiguration.job must be a non-empty name made of "
                f"letters, digits, '_', '.' or '-', got {shown(self.job)}"
            )
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _DTYPES:
                raise ValueError(
                    f"ShardingConfiguration.{name} must be one of "
                    f"{', '.join(_DTYPES)} or None (the parameters' own), got {shown(value)}"
                )
        for name in ("timeout_s", "join_window_s", "elastic_wait_s"):
            _check_seconds(name, getattr(self, name), none_ok=name == "timeout_s")
        if self.elastic and self.min_world_size > self.client.world_size:
            raise ValueError(
                f"ShardingConfiguration.min_world_size {self.min_world_size} is more than the"
                f" world size {self.client.world_size} (the most ranks an elastic job may have)"
            )
        if (
            self.timeout_s is not None
        ):  # the one deadline of every wait of this rank (client/rpc.py)
            self.client.timeout_s = float(self.timeout_s)

    def _check_client(self) -> None:
        client = self.client
        if client is None:
            raise ValueError(
                "ShardingConfiguration.client is required; "
                "use ShardingConfiguration.from_env() to build one from RANK, "
                "WORLD_SIZE and PARAMSHARD_SERVERS"
            )
        rank = getattr(client, "rank", None)
        world_size = getattr(client, "world_size", None)
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(
                "ShardingConfiguration.client.world_size must be an int >= 1,"
                f" got {shown(world_size)}"
            )
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(
                f"ShardingConfiguration.client.rank must be an int in "
                f"0..{world_size - 1}, got {shown(rank)}"
            )

    @property
    def effective_reduce_dtype(self) -> DType | None:
        """Dtype gradients actually travel in (None: each buffer's own dtype class; strategies
        read ``reduce_dtype_for``, which resolves it). As in FSDP2's ``MixedPrecisionPolicy``,
        ``reduce_dtype=None`` with a ``param_dtype`` reduces in that compute dtype.

        Compression means bfloat16 unless ``reduce_dtype`` already names a 16-bit type. This
        is derived rather than written back into ``reduce_dtype`` so that
        ``replace(config, enable_gradient_compression=False)`` really turns compression off.
        """
        if self.enable_gradient_compression and self.reduce_dtype not in _HALF:
            return "bfloat16"
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype

    def param_dtype_for(self, dtype: str) -> DType:
        """The dtype parameters of dtype class ``dtype`` (a buffer's master dtype, or any
        parameter dtype name) are gathered in: ``param_dtype``, or that class when None."""
        return _resolve(self.param_dtype, dtype)

    def reduce_dtype_for(self, dtype: str) -> DType:
        """The dtype gradients of parameters of dtype class ``dtype`` travel in:
        ``effective_reduce_dtype``, or that class when None."""
        return _resolve(self.effective_reduce_dtype, dtype)

    @classmethod
    def from_env(cls, **overrides: Any) -> ShardingConfiguration:
        """Build the client from the environment a launcher (torchrun style) sets.

        RANK and WORLD_SIZE default to 0 and 1 (a single process); the server addresses come
        from PARAMSHARD_SERVERS, and ``ClusterSpec.from_env`` says clearly when it is unset.
        When PARAMSHARD_CONFIG names a config file (``paramshard launch --config FILE`` sets
        it), that file is the base: keyword ``overrides`` win over it, and it over the defaults.
        """
        overrides = {**_elastic_from_env(), **overrides}
        path = os.environ.get(CONFIG_ENV, "").strip()
        if path:
            return cls.from_file(path, **overrides)
        return cls(_client_from_env(overrides.get("job")), **overrides)

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        client: ShardClient | None = None,
        **overrides: Any,
    ) -> ShardingConfiguration:
        """Build from a JSON, TOML or YAML file whose keys are this class's fields, ``client``
        excepted (protos/config_file.py). Keyword ``overrides`` win over the file, the file
        over the defaults; the client comes from the environment, as in ``from_env``, when not
        given. An unknown key or a bad value raises ``ValueError`` naming the file and field.
        """
        values = read_config_file(path)
        check_keys(values, _FILE_FIELDS, f"config file {os.fspath(path)}")
        if client is None:
            client = _client_from_env({**values, **overrides}.get("job"))
        try:
            return cls(client, **{**values, **overrides})
        except ValueError as exc:  # the constructor's message, plus where a bad value came from
            field = re.match(r"ShardingConfiguration\.(\w+)", str(exc))
            if field and field.group(1) in values and field.group(1) not in overrides:
                raise ValueError(f"{exc} (in config file {os.fspath(path)})") from None
            raise

    @classmethod
    def create_default(cls, client: ShardClient, **overrides: Any) -> ShardingConfiguration:
        """The defaults: full-precision gradients, 25 MiB buckets, reshard after forward."""
        return cls(client, **overrides)

    @classmethod
    def create_for_high_bandwidth(
        cls, client: ShardClient, **overrides: Any
    ) -> ShardingConfiguration:
        """For fast links (same host, datacenter network): spend bandwidth and memory.

        Large (100 MiB) buckets mean fewer round trips, whose fixed cost dominates on a fast
        link; gradients stay in full precision because compressing costs time and saves little; and
        FSDP keeps parameters gathered after forward so backward does not fetch them again.
        """
        settings: dict[str, Any] = {
            "bucket_size_bytes": 100 * 2**20,
            "enable_gradient_compression": False,
            "reshard_after_forward": False,
        }
        return cls(client, **{**settings, **overrides})

    @classmethod
    def create_for_low_bandwidth(
        cls, client: ShardClient, **overrides: Any
    ) -> ShardingConfiguration:
        """For slow links (across sites, shared networks): send as few bytes as possible.

        bfloat16 gradients halve the traffic and keep float32's exponent range, so they need
        no loss scaling. Buckets are small (4 MiB) because each one takes long to send: the
        first bucket leaves while backward is still computing later layers, so more of the
        transfer hides behind compute, and a retried request resends little. The timeout is
        longer because a full transfer legitimately takes longer.
        """
        settings: dict[str, Any] = {
            "enable_gradient_compression": True,
            "reduce_dtype": "bfloat16",
            "bucket_size_bytes": 4 * 2**20,
            "reshard_after_forward": True,
            "timeout_s": 600.0,
        }
        return cls(client, **{**settings, **overrides})


def _resolve(choice: DType | None, dtype: str) -> DType:
    """``choice`` for a buffer of dtype class ``master_dtype(dtype)``: None is the class
    itself, and nothing is wider than it (float64 asked of a float32 master is float32)."""
    master = master_dtype(dtype)
    if choice is None or (choice == "float64" and master == "float32"):
        return master
    return choice


def _check_seconds(name: str, value: object, *, none_ok: bool = False) -> None:
    if none_ok and value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        allowed = "a positive finite number of seconds" + (" or None (the client's)" * none_ok)
        raise ValueError(f"ShardingConfiguration.{name} must be {allowed}, got {shown(value)}")


def _check_int(name: str, value: object, *, minimum: int, none_ok: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an int >= {minimum}" + (" or None" if none_ok else "")
        raise ValueError(f"ShardingConfiguration.{name} must be {allowed}, got {shown(value)}")


_FILE_FIELDS = tuple(f.name for f in fields(ShardingConfiguration) if f.name != "client")


def _elastic_from_env() -> dict[str, Any]:
    """``elastic`` and ``min_world_size`` from PARAMSHARD_ELASTIC and PARAMSHARD_MIN_NPROC
    (``paramshard launch --elastic --min-nproc M`` sets them)."""
    from paramshard.client.membership import ELASTIC_ENV, MIN_NPROC_ENV

    out: dict[str, Any] = {}
    raw = os.environ.get(ELASTIC_ENV, "").strip()
    if raw:
        if raw not in ("0", "1"):
            raise ValueError(f"environment variable {ELASTIC_ENV} must be 0 or 1, got {raw!r}")
        out["elastic"] = raw == "1"
    if os.environ.get(MIN_NPROC_ENV, "").strip():
        out["min_world_size"] = _env_int(MIN_NPROC_ENV, 1)
    return out


def _client_from_env(job: Any) -> ShardClient:
    """Rank RANK of WORLD_SIZE on the servers of PARAMSHARD_SERVERS (torchrun's env), in the
    run the environment names, else in ``job``'s (client/run_id.py); the process's client for
    them where it has one open (client/from_env.py)."""
    from paramshard.client.from_env import client_from_env
    from paramshard.client.run_id import run_id_for

    if not isinstance(job, str) or not _JOB_NAME.fullmatch(job):
        job = _DEFAULT_JOB  # a bad one is refused by the configuration, with its reason
    return client_from_env(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1), run_id_for(job))


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name} must be an integer, got {shown(raw)}"
        ) from None
