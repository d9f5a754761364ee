"""The hot path's protobuf codec: TranslateRequest{chunk} and TranslateResponse{block} written and read without
protobuf objects, their tensors' bytes copied once on the way out and viewed in place on the way in. It writes the
bytes protobuf would and reads only the canonical form it writes (anything else goes through protobuf, whose
semantics are the contract's). Field numbers are read from translate.proto's generated descriptors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvferry.common.errors import InvalidInput
from kvferry.common.messages import Block, BlockBytes, BlockParts, Chunk
from kvferry.common.region_format import region_view
from kvferry.common.tensors import (
    FROM_PB,
    KIND_FROM_PB,
    KIND_TO_PB,
    checked_tensor,
    dtype_to_pb,
    tensor_pieces,
    view_bytes,
)
from kvferry.v1 import translate_pb2 as pb


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _scalar(field: int, value: int) -> list[bytes]:
    return [_varint(field << 3), _varint(value)] if value else []  # proto3 leaves zero scalars out


def _numbers(message, *names: str) -> tuple[int, ...]:
    """The field numbers of ``names`` in ``message``, as translate.proto declares them."""
    fields = message.DESCRIPTOR.fields_by_name
    return tuple(fields[n].number for n in names)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


_VARINT, _LEN = 0, 2
T_DTYPE, T_SHAPE, T_DATA, T_REGION_OFFSET = _numbers(pb.Tensor, "dtype", "shape", "data", "region_offset")
C_LAYER, C_KIND, C_START, C_END, C_TENSOR = _numbers(
    pb.SourceChunk, "layer", "kind", "token_start", "token_end", "tensor"
)
B_LAYER, B_START, B_END, B_INDEX, B_KEY, B_VALUE = _numbers(
    pb.TargetBlock, "layer", "token_start", "token_end", "block_index", "key", "value"
)
REQUEST_HEADER, REQUEST_CHUNK = _numbers(pb.TranslateRequest, "header", "chunk")
(RESPONSE_BLOCK,) = _numbers(pb.TranslateResponse, "block")
REQUEST_HEADER_TAG = _tag(REQUEST_HEADER, _LEN)
"""The first byte a serializer writes for a TranslateRequest{header}."""
REQUEST_CHUNK_TAG = _tag(REQUEST_CHUNK, _LEN)
"""The first byte of a serialised TranslateRequest{chunk} (and of no other request message)."""
RESPONSE_BLOCK_TAG = _tag(RESPONSE_BLOCK, _LEN)
_SHAPE_TAG, _DATA_TAG, _REGION_OFFSET_TAG = _tag(T_SHAPE, _LEN), _tag(T_DATA, _LEN), _tag(T_REGION_OFFSET, _VARINT)


def _tensor_fields(t: torch.Tensor, region=None) -> list[bytes]:
    """The fields of a kvferry.v1.Tensor: dtype, packed shape, then the data, taken straight from the tensor."""
    pieces = tensor_pieces(t) if t.numel() else []
    return _data_fields(t.dtype, t.shape, pieces, sum(map(len, pieces)), region)


def _parts_fields(parts: list[torch.Tensor], region=None) -> list[bytes]:
    """The fields of a kvferry.v1.Tensor joining ``parts`` ([heads, tokens_i, dim] each) along tokens: per head, each
    part's rows in turn, as pieces for the message's one join."""
    heads, _, dim = parts[0].shape
    pieces = [piece for h in range(heads) for p in parts if p.shape[1] for piece in tensor_pieces(p[h])]
    return _data_fields(
        parts[0].dtype, (heads, sum(p.shape[1] for p in parts), dim), pieces, sum(map(len, pieces)), region
    )


def _data_fields(dtype: torch.dtype, shape, pieces: list, size: int, region=None) -> list[bytes]:
    """The fields of a kvferry.v1.Tensor whose data is the concatenation of ``pieces`` (``size`` bytes): in the
    message, or (when ``region.put`` finds room for them) in the response region, the message saying where."""
    packed = b"".join(_varint(int(s)) for s in shape)
    out = _scalar(T_DTYPE, dtype_to_pb(dtype))
    if packed:
        out += [_SHAPE_TAG, _varint(len(packed)), packed]
    offset = region.put(pieces, size) if region is not None and size else None
    if offset is not None:
        out += [_REGION_OFFSET_TAG, _varint(offset)]  # written even when 0 (proto3 optional)
    elif size:
        out += [_DATA_TAG, _varint(size), *pieces]
    return out


def _length_delimited(field: int, parts: list[bytes]) -> list[bytes]:
    return [
        _varint(field << 3 | 2),
        _varint(sum(map(len, parts))),
        *parts,
    ]  # map, not a generator: ~3x faster over a hit's pieces


def encode_block_response(b: Block | BlockBytes | BlockParts, region=None) -> bytes:
    """A TranslateResponse carrying ``b``, serialised without building protobuf objects: the same bytes as
    ``block_to_pb(b).SerializeToString()`` (checked in the tests); the tensor data is copied once, into the message
    (for BlockBytes, straight from its pieces; for BlockParts, from each part's rows), or into ``region``: an object
    whose ``put(pieces, size)`` writes them and returns their offset there (a multiple of REGION_ALIGN), or None when
    they do not fit (then they go in the message)."""
    if isinstance(b, BlockBytes):
        k, v = (_data_fields(b.dtype, b.shape, pieces, b.nbytes // 2, region) for pieces in (b.key, b.value))
    elif isinstance(b, BlockParts):
        k, v = _parts_fields(b.keys, region), _parts_fields(b.values, region)
    else:
        k, v = _tensor_fields(b.key, region), _tensor_fields(b.value, region)
    body = (
        _scalar(B_LAYER, b.layer)
        + _scalar(B_START, b.start)
        + _scalar(B_END, b.end)
        + _scalar(B_INDEX, b.index)
        + _length_delimited(B_KEY, k)
        + _length_delimited(B_VALUE, v)
    )
    return b"".join(_length_delimited(RESPONSE_BLOCK, body))


def encode_chunk_request(c: Chunk) -> bytes:
    """A TranslateRequest carrying chunk ``c``: the bytes of ``chunk_to_pb(c).SerializeToString()``, built
    straight from the tensor (one copy of its data fewer, no protobuf objects)."""
    body = (
        _scalar(C_LAYER, c.layer)
        + _scalar(C_KIND, KIND_TO_PB[c.kind])
        + _scalar(C_START, c.start)
        + _scalar(C_END, c.end)
        + _length_delimited(C_TENSOR, _tensor_fields(c.tensor))
    )
    return b"".join(_length_delimited(REQUEST_CHUNK, body))


def serialize(msg) -> bytes:
    """Translate's serializer, both ways: pre-encoded chunks and blocks pass through, messages are serialised."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _read_varint(buf, i: int) -> tuple[int, int]:
    if i < len(buf) and buf[i] < 0x80:  # most tags and small values: one byte
        return buf[i], i + 1
    shift = value = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, value) pairs of one message: ints for varints, (offset, end) for length-delimited.
    Raises ValueError on other wire types or malformed input."""
    i = start
    while i < end:
        tag, i = _read_varint(buf, i)
        field, kind = tag >> 3, tag & 7
        if kind == 0:
            value, i = _read_varint(buf, i)
            if i > end:
                raise ValueError("varint runs past the message")
            yield field, value
        elif kind == 2:
            n, i = _read_varint(buf, i)
            if i + n > end:
                raise ValueError("field runs past the message")
            yield field, (i, i + n)
            i += n
        else:
            raise ValueError("unexpected wire type")


_U32 = 1 << 32


def _canonical(
    buf,
    lo: int,
    hi: int,
    ints: tuple[int, ...],
    messages: tuple[int, ...],
    enums: tuple[int, ...] = (),
    longs: tuple[int, ...] = (),
) -> dict:
    """The fields of one message in the canonical form the encoders above write: each field at most once, varints
    for ``ints`` (uint32: below 2**32), ``longs`` (uint64) and ``enums`` (int32: below 2**31), so no value that
    protobuf would truncate or sign-extend is read differently; (offset, end) for ``messages``. Raises ValueError on
    anything else: the caller then parses with protobuf, whose semantics are the contract's."""
    out: dict = {}
    for f, v in _fields(buf, lo, hi):
        if (
            f in out
            or isinstance(v, tuple) != (f in messages)
            or not (f in messages or f in ints or f in enums or f in longs)
        ):
            raise ValueError("non-canonical message")
        if not isinstance(v, tuple) and v >= (_U32 if f in ints else _U32 * _U32 if f in longs else _U32 >> 1):
            raise ValueError("varint past its type")
        out[f] = v
    return out


def _tensor_at(buf, span: tuple[int, int] | None, region=None) -> tuple[int, tuple[int, ...], memoryview]:
    """A kvferry.v1.Tensor at ``span`` of ``buf``: (dtype code, shape, a view of its data); an absent tensor is the
    empty message, as protobuf reads it. With a ``region``, a response tensor may carry region_offset instead of its
    data (its view is then one of the region)."""
    t = (
        _canonical(
            buf,
            *span,
            ints=(),
            messages=(T_SHAPE, T_DATA),
            enums=(T_DTYPE,),
            longs=(T_REGION_OFFSET,) if region is not None else (),
        )
        if span
        else {}
    )
    shape, (j, end) = [], t.get(T_SHAPE, (0, 0))
    while j < end:
        s_, j = _read_varint(buf, j)
        if s_ >= _U32:
            raise ValueError("shape past uint32")
        shape.append(s_)
    if j != end:
        raise ValueError("packed shape runs past its field")
    if T_REGION_OFFSET in t:
        if T_DATA in t:
            raise ValueError("data and region_offset both set")
        code = t.get(T_DTYPE, 0)
        if code not in FROM_PB:
            raise ValueError("unknown dtype")
        return code, tuple(shape), region_view(region, t[T_REGION_OFFSET], FROM_PB[code], shape)
    lo, hi = t.get(T_DATA, (0, 0))
    return t.get(T_DTYPE, 0), tuple(shape), buf[lo:hi]


def _only_field(buf, field: int) -> tuple[int, int]:
    ((f, span),) = list(_fields(buf, 0, len(buf)))
    if f != field or not isinstance(span, tuple):
        raise ValueError("another message")
    return span


def _fast_block(data: bytes, region=None) -> Block:
    """Parse a TranslateResponse{block} in the canonical form encode_block_response writes; the tensors
    view the received bytes (no copy), or the ``region`` their bytes lie in. Raises ValueError on anything else (the
    caller then uses protobuf)."""
    buf = memoryview(data)
    m = _canonical(
        buf, *_only_field(buf, RESPONSE_BLOCK), ints=(B_LAYER, B_START, B_END, B_INDEX), messages=(B_KEY, B_VALUE)
    )
    layer, start, end, index = (m.get(f, 0) for f in (B_LAYER, B_START, B_END, B_INDEX))
    what = f"block layer {layer} [{start}, {end})"
    kv = []
    for f, name in ((B_KEY, "key"), (B_VALUE, "value")):
        code, shape, raw = _tensor_at(buf, m.get(f), region)
        if code not in FROM_PB:
            raise ValueError("unknown dtype")
        try:
            kv.append(view_bytes(raw, FROM_PB[code], shape, f"{what} {name}"))
        except InvalidInput as e:
            raise ValueError(str(e)) from None
    return Block(layer, start, end, index, kv[0], kv[1])


@dataclass(frozen=True)
class ChunkFrame:
    """A received SourceChunk before its tensor is made: the fields as sent (kind and dtype as their wire codes) and
    the tensor's data as bytes, a view of the received message when it came in canonical form (no copy)."""

    layer: int
    kind: int
    start: int
    end: int
    dtype: int
    shape: tuple[int, ...]
    data: bytes | memoryview
    region_offset: bool = False  # the tensor claimed a region offset: refused (regions carry responses only)


def _fast_chunk(data: bytes) -> ChunkFrame:
    """Parse a TranslateRequest{chunk} in the canonical form encode_chunk_request writes, in place. Raises
    ValueError on anything else (the caller then uses protobuf)."""
    buf = memoryview(data)
    m = _canonical(
        buf, *_only_field(buf, REQUEST_CHUNK), ints=(C_LAYER, C_START, C_END), messages=(C_TENSOR,), enums=(C_KIND,)
    )
    return ChunkFrame(*(m.get(f, 0) for f in (C_LAYER, C_KIND, C_START, C_END)), *_tensor_at(buf, m.get(C_TENSOR)))


def frame_from_pb(m: pb.SourceChunk) -> ChunkFrame:
    """The frame of a chunk protobuf parsed (its data read once: each read of a bytes field copies it)."""
    return ChunkFrame(
        m.layer,
        m.kind,
        m.token_start,
        m.token_end,
        m.tensor.dtype,
        tuple(m.tensor.shape),
        m.tensor.data,
        m.tensor.HasField("region_offset"),
    )


def chunk_kind(f: ChunkFrame) -> str:
    """The chunk's kind, "k" or "v"."""
    if f.kind not in KIND_FROM_PB:
        raise InvalidInput(f"chunk for layer {f.layer}: kind must be KV_KIND_KEY or KV_KIND_VALUE")
    return KIND_FROM_PB[f.kind]


def chunk_from_frame(f: ChunkFrame, expect_shape=None, expect_dtype=None) -> Chunk:
    """The chunk, its tensor viewing the frame's bytes, after checking kind, dtype, shape and byte count."""
    kind = chunk_kind(f)
    what = f"chunk layer {f.layer} {kind.upper()} tokens [{f.start}, {f.end})"
    if f.region_offset:
        raise InvalidInput(f"{what}: a request tensor carries its bytes in data; region_offset is for responses")
    return Chunk(
        f.layer, kind, f.start, f.end, checked_tensor(f.dtype, f.shape, f.data, expect_shape, expect_dtype, what)
    )


def decode_request(data: bytes):
    """The Translate request deserializer's parse: a ChunkFrame for every chunk message (one in canonical form is
    parsed in place, its tensor bytes not copied; any other goes through protobuf), else the TranslateRequest."""
    if data[:1] == REQUEST_CHUNK_TAG:
        try:
            return _fast_chunk(data)
        except ValueError:
            pass
    msg = pb.TranslateRequest.FromString(data)
    return frame_from_pb(msg.chunk) if msg.WhichOneof("msg") == "chunk" else msg


def decode_response(data: bytes, region=None):
    """The Translate response deserializer: a Block for block messages (parsed in place), else the
    TranslateResponse (header, trailer, or any block not in canonical form). ``region``: the call's response region,
    where tensors sent with region_offset lie (see region_view)."""
    if data[:1] == RESPONSE_BLOCK_TAG:
        try:
            return _fast_block(data, region)
        except ValueError:
            pass
    return pb.TranslateResponse.FromString(data)
