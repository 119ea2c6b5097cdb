from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    BACKEND_GLOO: _ClassVar[Backend]
    BACKEND_NCCL: _ClassVar[Backend]

class PostedCut(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POSTED_CUT_ONE_RUN: _ClassVar[PostedCut]
    POSTED_CUT_FLAT: _ClassVar[PostedCut]
BACKEND_UNSPECIFIED: Backend
BACKEND_GLOO: Backend
BACKEND_NCCL: Backend
POSTED_CUT_ONE_RUN: PostedCut
POSTED_CUT_FLAT: PostedCut

class ConnectRequest(_message.Message):
    __slots__ = ("decode_worker_id", "backend", "layout_fingerprint", "ticket", "host_id")
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    decode_worker_id: str
    backend: Backend
    layout_fingerprint: str
    ticket: str
    host_id: str
    def __init__(self, decode_worker_id: _Optional[str] = ..., backend: _Optional[_Union[Backend, str]] = ..., layout_fingerprint: _Optional[str] = ..., ticket: _Optional[str] = ..., host_id: _Optional[str] = ...) -> None: ...

class ConnectReply(_message.Message):
    __slots__ = ("store_host", "store_port", "pair_id", "shm_name", "shm_bytes", "posted_pulls", "block_size", "chunk_bytes", "local_stream", "pool")
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    POSTED_PULLS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STREAM_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    store_host: str
    store_port: int
    pair_id: str
    shm_name: str
    shm_bytes: int
    posted_pulls: bool
    block_size: int
    chunk_bytes: int
    local_stream: str
    pool: PoolMemory
    def __init__(self, store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., pair_id: _Optional[str] = ..., shm_name: _Optional[str] = ..., shm_bytes: _Optional[int] = ..., posted_pulls: _Optional[bool] = ..., block_size: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., local_stream: _Optional[str] = ..., pool: _Optional[_Union[PoolMemory, _Mapping]] = ...) -> None: ...

class PoolMemory(_message.Message):
    __slots__ = ("pid", "fd", "nbytes", "nonce", "num_blocks", "header_bytes")
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HEADER_BYTES_FIELD_NUMBER: _ClassVar[int]
    pid: int
    fd: int
    nbytes: int
    nonce: bytes
    num_blocks: int
    header_bytes: int
    def __init__(self, pid: _Optional[int] = ..., fd: _Optional[int] = ..., nbytes: _Optional[int] = ..., nonce: _Optional[bytes] = ..., num_blocks: _Optional[int] = ..., header_bytes: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("request_id", "ticket", "decode_worker_id", "pair_id", "layout_fingerprint", "kv_head_start", "kv_head_count", "group_pulls", "shm_offset", "shm_capacity", "posted", "borrow", "skip_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    GROUP_PULLS_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    POSTED_FIELD_NUMBER: _ClassVar[int]
    BORROW_FIELD_NUMBER: _ClassVar[int]
    SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ticket: str
    decode_worker_id: str
    pair_id: str
    layout_fingerprint: str
    kv_head_start: int
    kv_head_count: int
    group_pulls: int
    shm_offset: int
    shm_capacity: int
    posted: PostedRecv
    borrow: bool
    skip_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., ticket: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., pair_id: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., kv_head_start: _Optional[int] = ..., kv_head_count: _Optional[int] = ..., group_pulls: _Optional[int] = ..., shm_offset: _Optional[int] = ..., shm_capacity: _Optional[int] = ..., posted: _Optional[_Union[PostedRecv, _Mapping]] = ..., borrow: _Optional[bool] = ..., skip_tokens: _Optional[int] = ...) -> None: ...

class PostedRecv(_message.Message):
    __slots__ = ("tag", "num_tokens", "num_blocks", "cut")
    TAG_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    tag: int
    num_tokens: int
    num_blocks: int
    cut: PostedCut
    def __init__(self, tag: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., cut: _Optional[_Union[PostedCut, str]] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("num_tokens", "shape", "dtype", "block_size", "tag", "chunk_bytes", "first_block", "runs", "shm_bytes", "layer_streamed", "posted", "borrowed_blocks", "groups")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_STREAMED_FIELD_NUMBER: _ClassVar[int]
    POSTED_FIELD_NUMBER: _ClassVar[int]
    BORROWED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    block_size: int
    tag: int
    chunk_bytes: int
    first_block: int
    runs: _containers.RepeatedScalarFieldContainer[int]
    shm_bytes: int
    layer_streamed: bool
    posted: bool
    borrowed_blocks: _containers.RepeatedScalarFieldContainer[int]
    groups: _containers.RepeatedCompositeFieldContainer[KvGroupSpan]
    def __init__(self, num_tokens: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., tag: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., first_block: _Optional[int] = ..., runs: _Optional[_Iterable[int]] = ..., shm_bytes: _Optional[int] = ..., layer_streamed: _Optional[bool] = ..., posted: _Optional[bool] = ..., borrowed_blocks: _Optional[_Iterable[int]] = ..., groups: _Optional[_Iterable[_Union[KvGroupSpan, _Mapping]]] = ...) -> None: ...

class PullStreamRequest(_message.Message):
    __slots__ = ("seq", "pull", "trace", "release")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    pull: PullRequest
    trace: _containers.ScalarMap[str, str]
    release: str
    def __init__(self, seq: _Optional[int] = ..., pull: _Optional[_Union[PullRequest, _Mapping]] = ..., trace: _Optional[_Mapping[str, str]] = ..., release: _Optional[str] = ...) -> None: ...

class PullStreamReply(_message.Message):
    __slots__ = ("seq", "reply", "code", "details")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    reply: PullReply
    code: int
    details: str
    def __init__(self, seq: _Optional[int] = ..., reply: _Optional[_Union[PullReply, _Mapping]] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class KvGroupSpan(_message.Message):
    __slots__ = ("num_layers", "first_block", "num_blocks")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    first_block: int
    num_blocks: int
    def __init__(self, num_layers: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...
