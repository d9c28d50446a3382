from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_ROLE_UNSPECIFIED: _ClassVar[TransferRole]
    TRANSFER_ROLE_SENDER: _ClassVar[TransferRole]
    TRANSFER_ROLE_RECEIVER: _ClassVar[TransferRole]

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_WAITING: _ClassVar[TransferState]
    TRANSFER_STATE_TRANSFERRING: _ClassVar[TransferState]
    TRANSFER_STATE_DONE: _ClassVar[TransferState]
    TRANSFER_STATE_FAILED: _ClassVar[TransferState]
    TRANSFER_STATE_ABORTED: _ClassVar[TransferState]
    TRANSFER_STATE_DEADLINE_EXCEEDED: _ClassVar[TransferState]
TRANSFER_ROLE_UNSPECIFIED: TransferRole
TRANSFER_ROLE_SENDER: TransferRole
TRANSFER_ROLE_RECEIVER: TransferRole
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_WAITING: TransferState
TRANSFER_STATE_TRANSFERRING: TransferState
TRANSFER_STATE_DONE: TransferState
TRANSFER_STATE_FAILED: TransferState
TRANSFER_STATE_ABORTED: TransferState
TRANSFER_STATE_DEADLINE_EXCEEDED: TransferState

class MhaSpec(_message.Message):
    __slots__ = ("layer_num", "head_num", "head_dim", "v_head_dim", "dtype", "page_size", "num_pages")
    LAYER_NUM_FIELD_NUMBER: _ClassVar[int]
    HEAD_NUM_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    V_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    layer_num: int
    head_num: int
    head_dim: int
    v_head_dim: int
    dtype: str
    page_size: int
    num_pages: int
    def __init__(self, layer_num: _Optional[int] = ..., head_num: _Optional[int] = ..., head_dim: _Optional[int] = ..., v_head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ...) -> None: ...

class MlaSpec(_message.Message):
    __slots__ = ("layer_num", "kv_lora_rank", "qk_rope_head_dim", "dtype", "page_size", "num_pages")
    LAYER_NUM_FIELD_NUMBER: _ClassVar[int]
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    QK_ROPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    layer_num: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str
    page_size: int
    num_pages: int
    def __init__(self, layer_num: _Optional[int] = ..., kv_lora_rank: _Optional[int] = ..., qk_rope_head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ...) -> None: ...

class Shape(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class MambaSpec(_message.Message):
    __slots__ = ("layer_num", "conv_state_shapes", "conv_dtype", "temporal_state_shape", "temporal_dtype", "num_slots")
    LAYER_NUM_FIELD_NUMBER: _ClassVar[int]
    CONV_STATE_SHAPES_FIELD_NUMBER: _ClassVar[int]
    CONV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TEMPORAL_STATE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    TEMPORAL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    layer_num: int
    conv_state_shapes: _containers.RepeatedCompositeFieldContainer[Shape]
    conv_dtype: str
    temporal_state_shape: Shape
    temporal_dtype: str
    num_slots: int
    def __init__(self, layer_num: _Optional[int] = ..., conv_state_shapes: _Optional[_Iterable[_Union[Shape, _Mapping]]] = ..., conv_dtype: _Optional[str] = ..., temporal_state_shape: _Optional[_Union[Shape, _Mapping]] = ..., temporal_dtype: _Optional[str] = ..., num_slots: _Optional[int] = ...) -> None: ...

class PoolSpec(_message.Message):
    __slots__ = ("mha", "mla", "mamba")
    MHA_FIELD_NUMBER: _ClassVar[int]
    MLA_FIELD_NUMBER: _ClassVar[int]
    MAMBA_FIELD_NUMBER: _ClassVar[int]
    mha: MhaSpec
    mla: MlaSpec
    mamba: MambaSpec
    def __init__(self, mha: _Optional[_Union[MhaSpec, _Mapping]] = ..., mla: _Optional[_Union[MlaSpec, _Mapping]] = ..., mamba: _Optional[_Union[MambaSpec, _Mapping]] = ...) -> None: ...

class ViewSpec(_message.Message):
    __slots__ = ("role", "index", "dtype", "shape", "stride", "offset_bytes")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    role: str
    index: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    offset_bytes: int
    def __init__(self, role: _Optional[str] = ..., index: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., offset_bytes: _Optional[int] = ...) -> None: ...

class PoolDescriptor(_message.Message):
    __slots__ = ("name", "spec", "anchor_bytes", "page_bytes", "num_pages", "page_size", "views")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    VIEWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: PoolSpec
    anchor_bytes: int
    page_bytes: int
    num_pages: int
    page_size: int
    views: _containers.RepeatedCompositeFieldContainer[ViewSpec]
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[PoolSpec, _Mapping]] = ..., anchor_bytes: _Optional[int] = ..., page_bytes: _Optional[int] = ..., num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., views: _Optional[_Iterable[_Union[ViewSpec, _Mapping]]] = ...) -> None: ...

class PageRun(_message.Message):
    __slots__ = ("start", "count")
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    start: int
    count: int
    def __init__(self, start: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class Extent(_message.Message):
    __slots__ = ("src_offset", "dst_offset", "nbytes")
    SRC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    src_offset: int
    dst_offset: int
    nbytes: int
    def __init__(self, src_offset: _Optional[int] = ..., dst_offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class SharedMemory(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CudaIpc(_message.Message):
    __slots__ = ("device", "storage_handle", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device: int
    storage_handle: bytes
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device: _Optional[int] = ..., storage_handle: _Optional[bytes] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class MemoryHandle(_message.Message):
    __slots__ = ("arena", "device", "size_bytes", "shm", "cuda")
    ARENA_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    arena: str
    device: str
    size_bytes: int
    shm: SharedMemory
    cuda: CudaIpc
    def __init__(self, arena: _Optional[str] = ..., device: _Optional[str] = ..., size_bytes: _Optional[int] = ..., shm: _Optional[_Union[SharedMemory, _Mapping]] = ..., cuda: _Optional[_Union[CudaIpc, _Mapping]] = ...) -> None: ...

class TransferStatus(_message.Message):
    __slots__ = ("transfer_id", "role", "state", "pool", "peer", "pages", "bytes", "bytes_done", "extents", "seconds", "error_code", "error", "verified", "created_unix", "data_seconds", "lanes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    DATA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    role: TransferRole
    state: TransferState
    pool: str
    peer: str
    pages: int
    bytes: int
    bytes_done: int
    extents: int
    seconds: float
    error_code: str
    error: str
    verified: bool
    created_unix: float
    data_seconds: float
    lanes: int
    def __init__(self, transfer_id: _Optional[str] = ..., role: _Optional[_Union[TransferRole, str]] = ..., state: _Optional[_Union[TransferState, str]] = ..., pool: _Optional[str] = ..., peer: _Optional[str] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ..., bytes_done: _Optional[int] = ..., extents: _Optional[int] = ..., seconds: _Optional[float] = ..., error_code: _Optional[str] = ..., error: _Optional[str] = ..., verified: _Optional[bool] = ..., created_unix: _Optional[float] = ..., data_seconds: _Optional[float] = ..., lanes: _Optional[int] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("descriptor", "memory")
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    descriptor: PoolDescriptor
    memory: MemoryHandle
    def __init__(self, descriptor: _Optional[_Union[PoolDescriptor, _Mapping]] = ..., memory: _Optional[_Union[MemoryHandle, _Mapping]] = ...) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ...) -> None: ...

class DescribePoolRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class DescribePagesRequest(_message.Message):
    __slots__ = ("pool", "runs")
    POOL_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    runs: _containers.RepeatedCompositeFieldContainer[PageRun]
    def __init__(self, pool: _Optional[str] = ..., runs: _Optional[_Iterable[_Union[PageRun, _Mapping]]] = ...) -> None: ...

class DescribePagesResponse(_message.Message):
    __slots__ = ("page_bytes", "extents")
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    page_bytes: int
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    def __init__(self, page_bytes: _Optional[int] = ..., extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ...) -> None: ...

class ExpectRequest(_message.Message):
    __slots__ = ("transfer_id", "pool", "dst_runs", "timeout_s")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    DST_RUNS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    pool: str
    dst_runs: _containers.RepeatedCompositeFieldContainer[PageRun]
    timeout_s: float
    def __init__(self, transfer_id: _Optional[str] = ..., pool: _Optional[str] = ..., dst_runs: _Optional[_Iterable[_Union[PageRun, _Mapping]]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("transfer_id", "pool", "src_runs", "peer", "timeout_s", "verify")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    SRC_RUNS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    pool: str
    src_runs: _containers.RepeatedCompositeFieldContainer[PageRun]
    peer: str
    timeout_s: float
    verify: bool
    def __init__(self, transfer_id: _Optional[str] = ..., pool: _Optional[str] = ..., src_runs: _Optional[_Iterable[_Union[PageRun, _Mapping]]] = ..., peer: _Optional[str] = ..., timeout_s: _Optional[float] = ..., verify: _Optional[bool] = ...) -> None: ...

class OfferRequest(_message.Message):
    __slots__ = ("transfer_id", "pool", "src_runs", "timeout_s", "verify")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    SRC_RUNS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    pool: str
    src_runs: _containers.RepeatedCompositeFieldContainer[PageRun]
    timeout_s: float
    verify: bool
    def __init__(self, transfer_id: _Optional[str] = ..., pool: _Optional[str] = ..., src_runs: _Optional[_Iterable[_Union[PageRun, _Mapping]]] = ..., timeout_s: _Optional[float] = ..., verify: _Optional[bool] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("transfer_id", "peer", "pool", "dst_runs", "timeout_s")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    DST_RUNS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    peer: str
    pool: str
    dst_runs: _containers.RepeatedCompositeFieldContainer[PageRun]
    timeout_s: float
    def __init__(self, transfer_id: _Optional[str] = ..., peer: _Optional[str] = ..., pool: _Optional[str] = ..., dst_runs: _Optional[_Iterable[_Union[PageRun, _Mapping]]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("transfer_id", "timeout_s")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    timeout_s: float
    def __init__(self, transfer_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("transfer_id", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ListTransfersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTransfersResponse(_message.Message):
    __slots__ = ("transfers",)
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    transfers: _containers.RepeatedCompositeFieldContainer[TransferStatus]
    def __init__(self, transfers: _Optional[_Iterable[_Union[TransferStatus, _Mapping]]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("session_id", "ucx_host", "ucx_port", "ucx_error_handling", "pools", "peer_address", "ucx_ports")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    UCX_HOST_FIELD_NUMBER: _ClassVar[int]
    UCX_PORT_FIELD_NUMBER: _ClassVar[int]
    UCX_ERROR_HANDLING_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UCX_PORTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ucx_host: str
    ucx_port: int
    ucx_error_handling: bool
    pools: _containers.RepeatedCompositeFieldContainer[PoolDescriptor]
    peer_address: str
    ucx_ports: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., ucx_host: _Optional[str] = ..., ucx_port: _Optional[int] = ..., ucx_error_handling: _Optional[bool] = ..., pools: _Optional[_Iterable[_Union[PoolDescriptor, _Mapping]]] = ..., peer_address: _Optional[str] = ..., ucx_ports: _Optional[_Iterable[int]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("session_id", "ucx_host", "ucx_port", "ucx_error_handling", "pools", "ucx_ports")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    UCX_HOST_FIELD_NUMBER: _ClassVar[int]
    UCX_PORT_FIELD_NUMBER: _ClassVar[int]
    UCX_ERROR_HANDLING_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    UCX_PORTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ucx_host: str
    ucx_port: int
    ucx_error_handling: bool
    pools: _containers.RepeatedCompositeFieldContainer[PoolDescriptor]
    ucx_ports: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., ucx_host: _Optional[str] = ..., ucx_port: _Optional[int] = ..., ucx_error_handling: _Optional[bool] = ..., pools: _Optional[_Iterable[_Union[PoolDescriptor, _Mapping]]] = ..., ucx_ports: _Optional[_Iterable[int]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("unix_time",)
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    unix_time: float
    def __init__(self, unix_time: _Optional[float] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("transfer_id", "session_id", "src_pool", "src_runs", "timeout_s", "verify", "chunk_bytes", "lanes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_POOL_FIELD_NUMBER: _ClassVar[int]
    SRC_RUNS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    session_id: str
    src_pool: str
    src_runs: _containers.RepeatedCompositeFieldContainer[PageRun]
    timeout_s: float
    verify: bool
    chunk_bytes: int
    lanes: int
    def __init__(self, transfer_id: _Optional[str] = ..., session_id: _Optional[str] = ..., src_pool: _Optional[str] = ..., src_runs: _Optional[_Iterable[_Union[PageRun, _Mapping]]] = ..., timeout_s: _Optional[float] = ..., verify: _Optional[bool] = ..., chunk_bytes: _Optional[int] = ..., lanes: _Optional[int] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("tag_base", "dst_pool", "dst_runs", "lanes")
    TAG_BASE_FIELD_NUMBER: _ClassVar[int]
    DST_POOL_FIELD_NUMBER: _ClassVar[int]
    DST_RUNS_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    tag_base: int
    dst_pool: str
    dst_runs: _containers.RepeatedCompositeFieldContainer[PageRun]
    lanes: int
    def __init__(self, tag_base: _Optional[int] = ..., dst_pool: _Optional[str] = ..., dst_runs: _Optional[_Iterable[_Union[PageRun, _Mapping]]] = ..., lanes: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("transfer_id", "session_id", "checksums")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    session_id: str
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[str] = ..., session_id: _Optional[str] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestPushRequest(_message.Message):
    __slots__ = ("transfer_id", "reply_to", "dst_pool", "timeout_s")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    DST_POOL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reply_to: str
    dst_pool: str
    timeout_s: float
    def __init__(self, transfer_id: _Optional[str] = ..., reply_to: _Optional[str] = ..., dst_pool: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RequestPushResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "session_id", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    session_id: str
    reason: str
    def __init__(self, transfer_id: _Optional[str] = ..., session_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortTransferResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
