from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]

class KVKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_KIND_UNSPECIFIED: _ClassVar[KVKind]
    KV_KIND_KEY: _ClassVar[KVKind]
    KV_KIND_VALUE: _ClassVar[KVKind]

class Layout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYOUT_UNSPECIFIED: _ClassVar[Layout]
    LAYOUT_CONTIGUOUS: _ClassVar[Layout]
    LAYOUT_PAGED: _ClassVar[Layout]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
KV_KIND_UNSPECIFIED: KVKind
KV_KIND_KEY: KVKind
KV_KIND_VALUE: KVKind
LAYOUT_UNSPECIFIED: Layout
LAYOUT_CONTIGUOUS: Layout
LAYOUT_PAGED: Layout

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "region_offset")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    REGION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    region_offset: int
    def __init__(self, dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., region_offset: _Optional[int] = ...) -> None: ...

class SharedRegion(_message.Message):
    __slots__ = ("name", "size", "key")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    key: bytes
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., key: _Optional[bytes] = ...) -> None: ...

class MapRef(_message.Message):
    __slots__ = ("name", "version", "latest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    latest: bool
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., latest: _Optional[bool] = ...) -> None: ...

class TranslateHeader(_message.Message):
    __slots__ = ("map", "source_geometry_fingerprint", "tokenizer_fingerprint", "num_tokens", "start_position", "token_ids", "source_dtype", "layout", "block_size", "target_dtype", "prefix_key", "tenant", "pages_per_block", "response_region")
    MAP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_GEOMETRY_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PAGES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_REGION_FIELD_NUMBER: _ClassVar[int]
    map: MapRef
    source_geometry_fingerprint: str
    tokenizer_fingerprint: str
    num_tokens: int
    start_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    source_dtype: Dtype
    layout: Layout
    block_size: int
    target_dtype: Dtype
    prefix_key: str
    tenant: str
    pages_per_block: int
    response_region: SharedRegion
    def __init__(self, map: _Optional[_Union[MapRef, _Mapping]] = ..., source_geometry_fingerprint: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., num_tokens: _Optional[int] = ..., start_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., source_dtype: _Optional[_Union[Dtype, str]] = ..., layout: _Optional[_Union[Layout, str]] = ..., block_size: _Optional[int] = ..., target_dtype: _Optional[_Union[Dtype, str]] = ..., prefix_key: _Optional[str] = ..., tenant: _Optional[str] = ..., pages_per_block: _Optional[int] = ..., response_region: _Optional[_Union[SharedRegion, _Mapping]] = ...) -> None: ...

class TranslateByKeyRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: TranslateHeader
    def __init__(self, header: _Optional[_Union[TranslateHeader, _Mapping]] = ...) -> None: ...

class SourceChunk(_message.Message):
    __slots__ = ("layer", "kind", "token_start", "token_end", "tensor")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    layer: int
    kind: KVKind
    token_start: int
    token_end: int
    tensor: Tensor
    def __init__(self, layer: _Optional[int] = ..., kind: _Optional[_Union[KVKind, str]] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class TranslateRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: TranslateHeader
    chunk: SourceChunk
    def __init__(self, header: _Optional[_Union[TranslateHeader, _Mapping]] = ..., chunk: _Optional[_Union[SourceChunk, _Mapping]] = ...) -> None: ...

class Geometry(_message.Message):
    __slots__ = ("architecture", "layers", "kv_heads", "head_dim", "fingerprint", "rope_type", "rope_theta")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ROPE_TYPE_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    layers: int
    kv_heads: int
    head_dim: int
    fingerprint: str
    rope_type: str
    rope_theta: float
    def __init__(self, architecture: _Optional[str] = ..., layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., fingerprint: _Optional[str] = ..., rope_type: _Optional[str] = ..., rope_theta: _Optional[float] = ...) -> None: ...

class TranslateResponseHeader(_message.Message):
    __slots__ = ("map_name", "map_version", "target", "layout", "block_size", "dtype", "num_tokens", "start_position", "pages_per_block", "response_region")
    MAP_NAME_FIELD_NUMBER: _ClassVar[int]
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    PAGES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_REGION_FIELD_NUMBER: _ClassVar[int]
    map_name: str
    map_version: str
    target: Geometry
    layout: Layout
    block_size: int
    dtype: Dtype
    num_tokens: int
    start_position: int
    pages_per_block: int
    response_region: bool
    def __init__(self, map_name: _Optional[str] = ..., map_version: _Optional[str] = ..., target: _Optional[_Union[Geometry, _Mapping]] = ..., layout: _Optional[_Union[Layout, str]] = ..., block_size: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., num_tokens: _Optional[int] = ..., start_position: _Optional[int] = ..., pages_per_block: _Optional[int] = ..., response_region: _Optional[bool] = ...) -> None: ...

class TargetBlock(_message.Message):
    __slots__ = ("layer", "token_start", "token_end", "block_index", "key", "value")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    token_start: int
    token_end: int
    block_index: int
    key: Tensor
    value: Tensor
    def __init__(self, layer: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., block_index: _Optional[int] = ..., key: _Optional[_Union[Tensor, _Mapping]] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class TranslateTrailer(_message.Message):
    __slots__ = ("tokens", "bytes_in", "bytes_out", "compute_seconds", "wall_seconds", "blocks", "cached_blocks")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    bytes_in: int
    bytes_out: int
    compute_seconds: float
    wall_seconds: float
    blocks: int
    cached_blocks: int
    def __init__(self, tokens: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., wall_seconds: _Optional[float] = ..., blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ...) -> None: ...

class TranslateResponse(_message.Message):
    __slots__ = ("header", "block", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: TranslateResponseHeader
    block: TargetBlock
    trailer: TranslateTrailer
    def __init__(self, header: _Optional[_Union[TranslateResponseHeader, _Mapping]] = ..., block: _Optional[_Union[TargetBlock, _Mapping]] = ..., trailer: _Optional[_Union[TranslateTrailer, _Mapping]] = ...) -> None: ...

class ListMappingsRequest(_message.Message):
    __slots__ = ("name_prefix",)
    NAME_PREFIX_FIELD_NUMBER: _ClassVar[int]
    name_prefix: str
    def __init__(self, name_prefix: _Optional[str] = ...) -> None: ...

class MapEvidence(_message.Message):
    __slots__ = ("arm", "top1", "top10", "kl", "attn_cos", "recommended_refresh", "drift_attn_cos", "drift_rel_err")
    ARM_FIELD_NUMBER: _ClassVar[int]
    TOP1_FIELD_NUMBER: _ClassVar[int]
    TOP10_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    ATTN_COS_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDED_REFRESH_FIELD_NUMBER: _ClassVar[int]
    DRIFT_ATTN_COS_FIELD_NUMBER: _ClassVar[int]
    DRIFT_REL_ERR_FIELD_NUMBER: _ClassVar[int]
    arm: str
    top1: float
    top10: float
    kl: float
    attn_cos: float
    recommended_refresh: int
    drift_attn_cos: float
    drift_rel_err: float
    def __init__(self, arm: _Optional[str] = ..., top1: _Optional[float] = ..., top10: _Optional[float] = ..., kl: _Optional[float] = ..., attn_cos: _Optional[float] = ..., recommended_refresh: _Optional[int] = ..., drift_attn_cos: _Optional[float] = ..., drift_rel_err: _Optional[float] = ...) -> None: ...

class MappingInfo(_message.Message):
    __slots__ = ("name", "version", "source", "target", "tokenizer_fingerprint", "content_sha256", "servable", "gate_reason", "evidence", "context_tokens", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_SHA256_FIELD_NUMBER: _ClassVar[int]
    SERVABLE_FIELD_NUMBER: _ClassVar[int]
    GATE_REASON_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    source: Geometry
    target: Geometry
    tokenizer_fingerprint: str
    content_sha256: str
    servable: bool
    gate_reason: str
    evidence: MapEvidence
    context_tokens: int
    dtype: Dtype
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., source: _Optional[_Union[Geometry, _Mapping]] = ..., target: _Optional[_Union[Geometry, _Mapping]] = ..., tokenizer_fingerprint: _Optional[str] = ..., content_sha256: _Optional[str] = ..., servable: _Optional[bool] = ..., gate_reason: _Optional[str] = ..., evidence: _Optional[_Union[MapEvidence, _Mapping]] = ..., context_tokens: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ...) -> None: ...

class ListMappingsResponse(_message.Message):
    __slots__ = ("mappings",)
    MAPPINGS_FIELD_NUMBER: _ClassVar[int]
    mappings: _containers.RepeatedCompositeFieldContainer[MappingInfo]
    def __init__(self, mappings: _Optional[_Iterable[_Union[MappingInfo, _Mapping]]] = ...) -> None: ...
