from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]

class ReduceOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SUM: _ClassVar[ReduceOp]
    MEAN: _ClassVar[ReduceOp]
    MAX: _ClassVar[ReduceOp]
    MIN: _ClassVar[ReduceOp]
    SET: _ClassVar[ReduceOp]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType
INT32: DType
FLOAT64: DType
SUM: ReduceOp
MEAN: ReduceOp
MAX: ReduceOp
MIN: ReduceOp
SET: ReduceOp

class BufferRef(_message.Message):
    __slots__ = ("job", "buffer")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    job: str
    buffer: str
    def __init__(self, job: _Optional[str] = ..., buffer: _Optional[str] = ...) -> None: ...

class ParamEntry(_message.Message):
    __slots__ = ("name", "shape", "dtype", "offset", "numel", "aliases", "split_dim", "split_parts", "split_index", "split_packed", "split_unit")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    SPLIT_DIM_FIELD_NUMBER: _ClassVar[int]
    SPLIT_PARTS_FIELD_NUMBER: _ClassVar[int]
    SPLIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SPLIT_PACKED_FIELD_NUMBER: _ClassVar[int]
    SPLIT_UNIT_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    offset: int
    numel: int
    aliases: _containers.RepeatedScalarFieldContainer[str]
    split_dim: int
    split_parts: int
    split_index: int
    split_packed: int
    split_unit: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., aliases: _Optional[_Iterable[str]] = ..., split_dim: _Optional[int] = ..., split_parts: _Optional[int] = ..., split_index: _Optional[int] = ..., split_packed: _Optional[int] = ..., split_unit: _Optional[int] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "hyper")
    class HyperEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    HYPER_FIELD_NUMBER: _ClassVar[int]
    name: str
    hyper: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., hyper: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RegisterBufferRequest(_message.Message):
    __slots__ = ("ref", "numel", "num_servers", "server_index", "contributors", "params", "optimizer", "master_dtype", "arrival_order", "model_config", "run")
    REF_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    NUM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    SERVER_INDEX_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MASTER_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_ORDER_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    ref: BufferRef
    numel: int
    num_servers: int
    server_index: int
    contributors: int
    params: _containers.RepeatedCompositeFieldContainer[ParamEntry]
    optimizer: OptimizerSpec
    master_dtype: DType
    arrival_order: bool
    model_config: str
    run: str
    def __init__(self, ref: _Optional[_Union[BufferRef, _Mapping]] = ..., numel: _Optional[int] = ..., num_servers: _Optional[int] = ..., server_index: _Optional[int] = ..., contributors: _Optional[int] = ..., params: _Optional[_Iterable[_Union[ParamEntry, _Mapping]]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., master_dtype: _Optional[_Union[DType, str]] = ..., arrival_order: _Optional[bool] = ..., model_config: _Optional[str] = ..., run: _Optional[str] = ...) -> None: ...

class RegisterBufferReply(_message.Message):
    __slots__ = ("slice_start", "slice_numel", "version", "initialized")
    SLICE_START_FIELD_NUMBER: _ClassVar[int]
    SLICE_NUMEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    slice_start: int
    slice_numel: int
    version: int
    initialized: bool
    def __init__(self, slice_start: _Optional[int] = ..., slice_numel: _Optional[int] = ..., version: _Optional[int] = ..., initialized: _Optional[bool] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "numel", "dtype")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    numel: int
    dtype: DType
    def __init__(self, offset: _Optional[int] = ..., numel: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class SetParamsHeader(_message.Message):
    __slots__ = ("ref", "chunk", "version", "state", "optimizer_steps", "shm")
    REF_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    ref: BufferRef
    chunk: Chunk
    version: int
    state: str
    optimizer_steps: int
    shm: ShmRef
    def __init__(self, ref: _Optional[_Union[BufferRef, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., version: _Optional[int] = ..., state: _Optional[str] = ..., optimizer_steps: _Optional[int] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ...) -> None: ...

class SetParamsRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: SetParamsHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[SetParamsHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SetParamsReply(_message.Message):
    __slots__ = ("initialized",)
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    initialized: bool
    def __init__(self, initialized: _Optional[bool] = ...) -> None: ...

class StepArgs(_message.Message):
    __slots__ = ("hyper", "clip_coef")
    class HyperEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    HYPER_FIELD_NUMBER: _ClassVar[int]
    CLIP_COEF_FIELD_NUMBER: _ClassVar[int]
    hyper: _containers.ScalarMap[str, float]
    clip_coef: float
    def __init__(self, hyper: _Optional[_Mapping[str, float]] = ..., clip_coef: _Optional[float] = ...) -> None: ...

class PushGradHeader(_message.Message):
    __slots__ = ("ref", "chunk", "step", "contributor", "micro", "num_micro", "step_args", "shm", "membership")
    REF_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTOR_FIELD_NUMBER: _ClassVar[int]
    MICRO_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_FIELD_NUMBER: _ClassVar[int]
    STEP_ARGS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    ref: BufferRef
    chunk: Chunk
    step: int
    contributor: int
    micro: int
    num_micro: int
    step_args: StepArgs
    shm: ShmRef
    membership: StepMembership
    def __init__(self, ref: _Optional[_Union[BufferRef, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., step: _Optional[int] = ..., contributor: _Optional[int] = ..., micro: _Optional[int] = ..., num_micro: _Optional[int] = ..., step_args: _Optional[_Union[StepArgs, _Mapping]] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ..., membership: _Optional[_Union[StepMembership, _Mapping]] = ...) -> None: ...

class StepMembership(_message.Message):
    __slots__ = ("generation", "members", "global_batch")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    generation: int
    members: _containers.RepeatedScalarFieldContainer[int]
    global_batch: int
    def __init__(self, generation: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., global_batch: _Optional[int] = ...) -> None: ...

class PushGradRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushGradHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushGradHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushGradReply(_message.Message):
    __slots__ = ("duplicate", "reduced", "version")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    REDUCED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    reduced: bool
    version: int
    def __init__(self, duplicate: _Optional[bool] = ..., reduced: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class PullParamsRequest(_message.Message):
    __slots__ = ("ref", "min_version", "chunk", "state", "reply_shm")
    REF_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REPLY_SHM_FIELD_NUMBER: _ClassVar[int]
    ref: BufferRef
    min_version: int
    chunk: Chunk
    state: str
    reply_shm: ShmRef
    def __init__(self, ref: _Optional[_Union[BufferRef, _Mapping]] = ..., min_version: _Optional[int] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., state: _Optional[str] = ..., reply_shm: _Optional[_Union[ShmRef, _Mapping]] = ...) -> None: ...

class PullParamsHeader(_message.Message):
    __slots__ = ("ref", "chunk", "version", "optimizer_steps", "shm")
    REF_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    ref: BufferRef
    chunk: Chunk
    version: int
    optimizer_steps: int
    shm: ShmRef
    def __init__(self, ref: _Optional[_Union[BufferRef, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., version: _Optional[int] = ..., optimizer_steps: _Optional[int] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ...) -> None: ...

class PullParamsReply(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PullParamsHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PullParamsHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class GradNormRequest(_message.Message):
    __slots__ = ("job", "buffers", "step", "per_param", "generation")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PER_PARAM_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    buffers: _containers.RepeatedScalarFieldContainer[str]
    step: int
    per_param: bool
    generation: int
    def __init__(self, job: _Optional[str] = ..., buffers: _Optional[_Iterable[str]] = ..., step: _Optional[int] = ..., per_param: _Optional[bool] = ..., generation: _Optional[int] = ...) -> None: ...

class GradNormReply(_message.Message):
    __slots__ = ("sum_squares", "param_sum_squares", "finite")
    SUM_SQUARES_FIELD_NUMBER: _ClassVar[int]
    PARAM_SUM_SQUARES_FIELD_NUMBER: _ClassVar[int]
    FINITE_FIELD_NUMBER: _ClassVar[int]
    sum_squares: _containers.RepeatedScalarFieldContainer[float]
    param_sum_squares: _containers.RepeatedScalarFieldContainer[float]
    finite: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, sum_squares: _Optional[_Iterable[float]] = ..., param_sum_squares: _Optional[_Iterable[float]] = ..., finite: _Optional[_Iterable[bool]] = ...) -> None: ...

class BufferStep(_message.Message):
    __slots__ = ("buffer", "args")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    buffer: str
    args: StepArgs
    def __init__(self, buffer: _Optional[str] = ..., args: _Optional[_Union[StepArgs, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("job", "step", "buffers", "skip", "generation")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    buffers: _containers.RepeatedCompositeFieldContainer[BufferStep]
    skip: bool
    generation: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., buffers: _Optional[_Iterable[_Union[BufferStep, _Mapping]]] = ..., skip: _Optional[bool] = ..., generation: _Optional[int] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, versions: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("run", "rank", "world_size", "epoch", "ttl_ms", "rejoin_ms", "release", "abort", "stream", "holder", "client", "fresh", "ends", "final", "restarted", "launch")
    RUN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    REJOIN_MS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    FRESH_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_FIELD_NUMBER: _ClassVar[int]
    run: str
    rank: int
    world_size: int
    epoch: int
    ttl_ms: int
    rejoin_ms: int
    release: bool
    abort: str
    stream: bool
    holder: str
    client: int
    fresh: bool
    ends: bool
    final: bool
    restarted: bool
    launch: str
    def __init__(self, run: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., epoch: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., rejoin_ms: _Optional[int] = ..., release: _Optional[bool] = ..., abort: _Optional[str] = ..., stream: _Optional[bool] = ..., holder: _Optional[str] = ..., client: _Optional[int] = ..., fresh: _Optional[bool] = ..., ends: _Optional[bool] = ..., final: _Optional[bool] = ..., restarted: _Optional[bool] = ..., launch: _Optional[str] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("aborted", "aborted_epoch", "lost_rank", "awaiting", "incarnation", "final", "took_over")
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOST_RANK_FIELD_NUMBER: _ClassVar[int]
    AWAITING_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    TOOK_OVER_FIELD_NUMBER: _ClassVar[int]
    aborted: str
    aborted_epoch: int
    lost_rank: int
    awaiting: _containers.RepeatedScalarFieldContainer[int]
    incarnation: int
    final: bool
    took_over: bool
    def __init__(self, aborted: _Optional[str] = ..., aborted_epoch: _Optional[int] = ..., lost_rank: _Optional[int] = ..., awaiting: _Optional[_Iterable[int]] = ..., incarnation: _Optional[int] = ..., final: _Optional[bool] = ..., took_over: _Optional[bool] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("run", "job", "rank", "world_size", "step", "epoch", "min_members", "window_ms", "known_members", "leave", "recovery", "done")
    RUN_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MIN_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_MS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    run: str
    job: str
    rank: int
    world_size: int
    step: int
    epoch: int
    min_members: int
    window_ms: int
    known_members: _containers.RepeatedScalarFieldContainer[int]
    leave: bool
    recovery: bool
    done: bool
    def __init__(self, run: _Optional[str] = ..., job: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., step: _Optional[int] = ..., epoch: _Optional[int] = ..., min_members: _Optional[int] = ..., window_ms: _Optional[int] = ..., known_members: _Optional[_Iterable[int]] = ..., leave: _Optional[bool] = ..., recovery: _Optional[bool] = ..., done: _Optional[bool] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("decided", "member", "step", "generation", "members", "epoch", "next_step", "announced", "expected", "leader", "done", "in_flight", "below_min", "send_known", "announced_count", "expected_count", "retry_after_ms", "applied")
    DECIDED_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCED_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    BELOW_MIN_FIELD_NUMBER: _ClassVar[int]
    SEND_KNOWN_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCED_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    decided: bool
    member: bool
    step: int
    generation: int
    members: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    next_step: int
    announced: _containers.RepeatedScalarFieldContainer[int]
    expected: _containers.RepeatedScalarFieldContainer[int]
    leader: int
    done: bool
    in_flight: bool
    below_min: bool
    send_known: bool
    announced_count: int
    expected_count: int
    retry_after_ms: int
    applied: int
    def __init__(self, decided: _Optional[bool] = ..., member: _Optional[bool] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ..., next_step: _Optional[int] = ..., announced: _Optional[_Iterable[int]] = ..., expected: _Optional[_Iterable[int]] = ..., leader: _Optional[int] = ..., done: _Optional[bool] = ..., in_flight: _Optional[bool] = ..., below_min: _Optional[bool] = ..., send_known: _Optional[bool] = ..., announced_count: _Optional[int] = ..., expected_count: _Optional[int] = ..., retry_after_ms: _Optional[int] = ..., applied: _Optional[int] = ...) -> None: ...

class SlotHeader(_message.Message):
    __slots__ = ("key", "op", "expected", "readers", "total_numel", "shape", "chunk", "contributor", "chunk_numel", "arrival_order", "shm", "reply_shm")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    READERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUMEL_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_NUMEL_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_ORDER_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    REPLY_SHM_FIELD_NUMBER: _ClassVar[int]
    key: str
    op: ReduceOp
    expected: int
    readers: int
    total_numel: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    chunk: Chunk
    contributor: int
    chunk_numel: int
    arrival_order: bool
    shm: ShmRef
    reply_shm: ShmRef
    def __init__(self, key: _Optional[str] = ..., op: _Optional[_Union[ReduceOp, str]] = ..., expected: _Optional[int] = ..., readers: _Optional[int] = ..., total_numel: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., contributor: _Optional[int] = ..., chunk_numel: _Optional[int] = ..., arrival_order: _Optional[bool] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ..., reply_shm: _Optional[_Union[ShmRef, _Mapping]] = ...) -> None: ...

class ContributeRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: SlotHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[SlotHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ContributeReply(_message.Message):
    __slots__ = ("duplicate",)
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    def __init__(self, duplicate: _Optional[bool] = ...) -> None: ...

class ReadSlotRequest(_message.Message):
    __slots__ = ("key", "offset", "reader", "reply_shm", "guess")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    READER_FIELD_NUMBER: _ClassVar[int]
    REPLY_SHM_FIELD_NUMBER: _ClassVar[int]
    GUESS_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    reader: int
    reply_shm: ShmRef
    guess: bool
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., reader: _Optional[int] = ..., reply_shm: _Optional[_Union[ShmRef, _Mapping]] = ..., guess: _Optional[bool] = ...) -> None: ...

class ReadSlotReply(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: SlotHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[SlotHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SessionCall(_message.Message):
    __slots__ = ("id", "method", "body", "timeout_s", "code", "details")
    ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    id: int
    method: str
    body: bytes
    timeout_s: float
    code: int
    details: str
    def __init__(self, id: _Optional[int] = ..., method: _Optional[str] = ..., body: _Optional[bytes] = ..., timeout_s: _Optional[float] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class SessionBatch(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[SessionCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[SessionCall, _Mapping]]] = ...) -> None: ...

class DropJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class DropJobReply(_message.Message):
    __slots__ = ("buffers",)
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    buffers: int
    def __init__(self, buffers: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("pending", "max_pending")
    PENDING_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_FIELD_NUMBER: _ClassVar[int]
    pending: bool
    max_pending: int
    def __init__(self, pending: _Optional[bool] = ..., max_pending: _Optional[int] = ...) -> None: ...

class PendingWork(_message.Message):
    __slots__ = ("run", "kind", "seq", "key", "part", "expected", "arrived", "missing", "waiting", "unread_by", "age_seconds", "idle_seconds", "bytes", "channel", "whereabouts")
    RUN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    UNREAD_BY_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    WHEREABOUTS_FIELD_NUMBER: _ClassVar[int]
    run: str
    kind: str
    seq: int
    key: str
    part: int
    expected: int
    arrived: _containers.RepeatedScalarFieldContainer[int]
    missing: _containers.RepeatedScalarFieldContainer[int]
    waiting: _containers.RepeatedScalarFieldContainer[int]
    unread_by: _containers.RepeatedScalarFieldContainer[int]
    age_seconds: float
    idle_seconds: float
    bytes: int
    channel: str
    whereabouts: str
    def __init__(self, run: _Optional[str] = ..., kind: _Optional[str] = ..., seq: _Optional[int] = ..., key: _Optional[str] = ..., part: _Optional[int] = ..., expected: _Optional[int] = ..., arrived: _Optional[_Iterable[int]] = ..., missing: _Optional[_Iterable[int]] = ..., waiting: _Optional[_Iterable[int]] = ..., unread_by: _Optional[_Iterable[int]] = ..., age_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., channel: _Optional[str] = ..., whereabouts: _Optional[str] = ...) -> None: ...

class BufferStatus(_message.Message):
    __slots__ = ("buffer", "numel", "slice_start", "slice_numel", "dtype", "version", "initialized", "optimizer", "param_bytes", "grad_bytes", "optimizer_bytes", "params", "last_step_seconds", "last_step_unix", "contributors", "hyper", "state_keys", "optimizer_steps", "skipped_steps")
    class HyperEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    SLICE_START_FIELD_NUMBER: _ClassVar[int]
    SLICE_NUMEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_UNIX_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    HYPER_FIELD_NUMBER: _ClassVar[int]
    STATE_KEYS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    buffer: str
    numel: int
    slice_start: int
    slice_numel: int
    dtype: str
    version: int
    initialized: bool
    optimizer: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    params: _containers.RepeatedCompositeFieldContainer[ParamEntry]
    last_step_seconds: float
    last_step_unix: float
    contributors: int
    hyper: _containers.ScalarMap[str, float]
    state_keys: _containers.RepeatedScalarFieldContainer[str]
    optimizer_steps: int
    skipped_steps: int
    def __init__(self, buffer: _Optional[str] = ..., numel: _Optional[int] = ..., slice_start: _Optional[int] = ..., slice_numel: _Optional[int] = ..., dtype: _Optional[str] = ..., version: _Optional[int] = ..., initialized: _Optional[bool] = ..., optimizer: _Optional[str] = ..., param_bytes: _Optional[int] = ..., grad_bytes: _Optional[int] = ..., optimizer_bytes: _Optional[int] = ..., params: _Optional[_Iterable[_Union[ParamEntry, _Mapping]]] = ..., last_step_seconds: _Optional[float] = ..., last_step_unix: _Optional[float] = ..., contributors: _Optional[int] = ..., hyper: _Optional[_Mapping[str, float]] = ..., state_keys: _Optional[_Iterable[str]] = ..., optimizer_steps: _Optional[int] = ..., skipped_steps: _Optional[int] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job", "buffers", "server_index", "num_servers", "model_config")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    SERVER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    job: str
    buffers: _containers.RepeatedCompositeFieldContainer[BufferStatus]
    server_index: int
    num_servers: int
    model_config: str
    def __init__(self, job: _Optional[str] = ..., buffers: _Optional[_Iterable[_Union[BufferStatus, _Mapping]]] = ..., server_index: _Optional[int] = ..., num_servers: _Optional[int] = ..., model_config: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("server_index", "num_servers", "device", "device_memory_used", "device_memory_total", "uptime_seconds", "jobs", "slot_bytes", "open_slots", "version", "pid", "memory_used", "memory_limit", "pending", "pending_left_out", "memberships")
    SERVER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPEN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    PENDING_LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIPS_FIELD_NUMBER: _ClassVar[int]
    server_index: int
    num_servers: int
    device: str
    device_memory_used: int
    device_memory_total: int
    uptime_seconds: float
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    slot_bytes: int
    open_slots: int
    version: str
    pid: int
    memory_used: int
    memory_limit: int
    pending: _containers.RepeatedCompositeFieldContainer[PendingWork]
    pending_left_out: int
    memberships: _containers.RepeatedCompositeFieldContainer[JobMembership]
    def __init__(self, server_index: _Optional[int] = ..., num_servers: _Optional[int] = ..., device: _Optional[str] = ..., device_memory_used: _Optional[int] = ..., device_memory_total: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., slot_bytes: _Optional[int] = ..., open_slots: _Optional[int] = ..., version: _Optional[str] = ..., pid: _Optional[int] = ..., memory_used: _Optional[int] = ..., memory_limit: _Optional[int] = ..., pending: _Optional[_Iterable[_Union[PendingWork, _Mapping]]] = ..., pending_left_out: _Optional[int] = ..., memberships: _Optional[_Iterable[_Union[JobMembership, _Mapping]]] = ...) -> None: ...

class MembershipEvent(_message.Message):
    __slots__ = ("step", "kind", "rank", "unix", "generation")
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    step: int
    kind: str
    rank: int
    unix: float
    generation: int
    def __init__(self, step: _Optional[int] = ..., kind: _Optional[str] = ..., rank: _Optional[int] = ..., unix: _Optional[float] = ..., generation: _Optional[int] = ...) -> None: ...

class JobMembership(_message.Message):
    __slots__ = ("job", "run", "step", "generation", "members", "min_members", "joins", "leaves", "revisions", "steps_by_world_size", "history", "waiting")
    class StepsByWorldSizeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MIN_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    JOINS_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    REVISIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_BY_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    job: str
    run: str
    step: int
    generation: int
    members: _containers.RepeatedScalarFieldContainer[int]
    min_members: int
    joins: int
    leaves: int
    revisions: int
    steps_by_world_size: _containers.ScalarMap[int, int]
    history: _containers.RepeatedCompositeFieldContainer[MembershipEvent]
    waiting: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job: _Optional[str] = ..., run: _Optional[str] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., min_members: _Optional[int] = ..., joins: _Optional[int] = ..., leaves: _Optional[int] = ..., revisions: _Optional[int] = ..., steps_by_world_size: _Optional[_Mapping[int, int]] = ..., history: _Optional[_Iterable[_Union[MembershipEvent, _Mapping]]] = ..., waiting: _Optional[_Iterable[int]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("job", "tag", "version", "server_index", "num_servers")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    job: str
    tag: str
    version: int
    server_index: int
    num_servers: int
    def __init__(self, job: _Optional[str] = ..., tag: _Optional[str] = ..., version: _Optional[int] = ..., server_index: _Optional[int] = ..., num_servers: _Optional[int] = ...) -> None: ...

class SnapshotReply(_message.Message):
    __slots__ = ("file", "bytes", "sha256", "version", "buffers")
    FILE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    file: str
    bytes: int
    sha256: str
    version: int
    buffers: _containers.RepeatedCompositeFieldContainer[BufferStatus]
    def __init__(self, file: _Optional[str] = ..., bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., version: _Optional[int] = ..., buffers: _Optional[_Iterable[_Union[BufferStatus, _Mapping]]] = ...) -> None: ...

class CommitSnapshotRequest(_message.Message):
    __slots__ = ("job", "tag", "manifest_json")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    job: str
    tag: str
    manifest_json: str
    def __init__(self, job: _Optional[str] = ..., tag: _Optional[str] = ..., manifest_json: _Optional[str] = ...) -> None: ...

class CommitSnapshotReply(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("job", "tag", "server_index", "num_servers", "contributors", "check_only", "run", "into")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    SERVER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    CHECK_ONLY_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    INTO_FIELD_NUMBER: _ClassVar[int]
    job: str
    tag: str
    server_index: int
    num_servers: int
    contributors: int
    check_only: bool
    run: str
    into: str
    def __init__(self, job: _Optional[str] = ..., tag: _Optional[str] = ..., server_index: _Optional[int] = ..., num_servers: _Optional[int] = ..., contributors: _Optional[int] = ..., check_only: _Optional[bool] = ..., run: _Optional[str] = ..., into: _Optional[str] = ...) -> None: ...

class RestoreReply(_message.Message):
    __slots__ = ("tag", "version", "buffers")
    TAG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    tag: str
    version: int
    buffers: int
    def __init__(self, tag: _Optional[str] = ..., version: _Optional[int] = ..., buffers: _Optional[int] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ("job", "torn")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TORN_FIELD_NUMBER: _ClassVar[int]
    job: str
    torn: bool
    def __init__(self, job: _Optional[str] = ..., torn: _Optional[bool] = ...) -> None: ...

class SnapshotInfo(_message.Message):
    __slots__ = ("job", "tag", "version", "num_servers", "created_unix", "servers", "cluster_servers", "parts", "torn")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_SERVERS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    TORN_FIELD_NUMBER: _ClassVar[int]
    job: str
    tag: str
    version: int
    num_servers: int
    created_unix: float
    servers: _containers.RepeatedScalarFieldContainer[int]
    cluster_servers: int
    parts: _containers.RepeatedScalarFieldContainer[str]
    torn: bool
    def __init__(self, job: _Optional[str] = ..., tag: _Optional[str] = ..., version: _Optional[int] = ..., num_servers: _Optional[int] = ..., created_unix: _Optional[float] = ..., servers: _Optional[_Iterable[int]] = ..., cluster_servers: _Optional[int] = ..., parts: _Optional[_Iterable[str]] = ..., torn: _Optional[bool] = ...) -> None: ...

class ListSnapshotsReply(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotInfo]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotInfo, _Mapping]]] = ...) -> None: ...

class DeleteSnapshotRequest(_message.Message):
    __slots__ = ("job", "tag", "check_only")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    CHECK_ONLY_FIELD_NUMBER: _ClassVar[int]
    job: str
    tag: str
    check_only: bool
    def __init__(self, job: _Optional[str] = ..., tag: _Optional[str] = ..., check_only: _Optional[bool] = ...) -> None: ...

class DeleteSnapshotReply(_message.Message):
    __slots__ = ("found", "files", "bytes", "complete", "kept", "more_kept")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    MORE_KEPT_FIELD_NUMBER: _ClassVar[int]
    found: bool
    files: int
    bytes: int
    complete: bool
    kept: _containers.RepeatedScalarFieldContainer[str]
    more_kept: int
    def __init__(self, found: _Optional[bool] = ..., files: _Optional[int] = ..., bytes: _Optional[int] = ..., complete: _Optional[bool] = ..., kept: _Optional[_Iterable[str]] = ..., more_kept: _Optional[int] = ...) -> None: ...

class ReplicationConfig(_message.Message):
    __slots__ = ("job", "every", "neighbour", "server_index", "num_servers", "token")
    JOB_FIELD_NUMBER: _ClassVar[int]
    EVERY_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOUR_FIELD_NUMBER: _ClassVar[int]
    SERVER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    job: str
    every: int
    neighbour: str
    server_index: int
    num_servers: int
    token: str
    def __init__(self, job: _Optional[str] = ..., every: _Optional[int] = ..., neighbour: _Optional[str] = ..., server_index: _Optional[int] = ..., num_servers: _Optional[int] = ..., token: _Optional[str] = ...) -> None: ...

class ReplicationConfigReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaChunk(_message.Message):
    __slots__ = ("job", "source_index", "version", "offset", "total", "shm", "data")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    job: str
    source_index: int
    version: int
    offset: int
    total: int
    shm: ShmRef
    data: bytes
    def __init__(self, job: _Optional[str] = ..., source_index: _Optional[int] = ..., version: _Optional[int] = ..., offset: _Optional[int] = ..., total: _Optional[int] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReplicaAck(_message.Message):
    __slots__ = ("complete",)
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    complete: bool
    def __init__(self, complete: _Optional[bool] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("source_index", "version", "bytes", "own")
    SOURCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    OWN_FIELD_NUMBER: _ClassVar[int]
    source_index: int
    version: int
    bytes: int
    own: bool
    def __init__(self, source_index: _Optional[int] = ..., version: _Optional[int] = ..., bytes: _Optional[int] = ..., own: _Optional[bool] = ...) -> None: ...

class ListReplicasReply(_message.Message):
    __slots__ = ("server_index", "replicas", "failure")
    SERVER_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    server_index: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    failure: str
    def __init__(self, server_index: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., failure: _Optional[str] = ...) -> None: ...

class FetchReplicaRequest(_message.Message):
    __slots__ = ("job", "source_index", "version", "offset", "max_bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    source_index: int
    version: int
    offset: int
    max_bytes: int
    def __init__(self, job: _Optional[str] = ..., source_index: _Optional[int] = ..., version: _Optional[int] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("job", "version")
    JOB_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job: str
    version: int
    def __init__(self, job: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ShmRef(_message.Message):
    __slots__ = ("segment", "offset", "nbytes")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    segment: int
    offset: int
    nbytes: int
    def __init__(self, segment: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class OfferSegmentRequest(_message.Message):
    __slots__ = ("nbytes",)
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    def __init__(self, nbytes: _Optional[int] = ...) -> None: ...

class OfferSegmentReply(_message.Message):
    __slots__ = ("segment", "socket", "ticket", "nbytes")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    segment: int
    socket: str
    ticket: bytes
    nbytes: int
    def __init__(self, segment: _Optional[int] = ..., socket: _Optional[str] = ..., ticket: _Optional[bytes] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ConfirmSegmentRequest(_message.Message):
    __slots__ = ("segment", "proof")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    segment: int
    proof: bytes
    def __init__(self, segment: _Optional[int] = ..., proof: _Optional[bytes] = ...) -> None: ...

class ConfirmSegmentReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseSegmentsRequest(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, segments: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseSegmentsReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...
