"""The tensor wire codec: the hand-written fast paths produce and read exactly the protobuf wire format."""

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.common import wire
from kvferry.common.messages import Block, BlockParts, Chunk
from kvferry.v1 import translate_pb2 as pb

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_tensor(shape, dtype, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g).to(dtype)
    if strided and len(shape) == 3 and shape[1] > 1:  # a token-range view of a longer tensor, as the encoders see
        t = torch.randn(shape[0], shape[1] * 2, shape[2], generator=g).to(dtype)[:, 1 : 1 + shape[1]]
    return t


blocks = st.builds(
    lambda layer, start, n, index, heads, dim, dtype, strided: Block(
        layer,
        start,
        start + n,
        index,
        make_tensor((heads, n, dim), dtype, 1, strided),
        make_tensor((heads, n, dim), dtype, 2, strided),
    ),
    st.integers(0, 300),
    st.integers(0, 1 << 20),
    st.integers(0, 40),
    st.integers(0, 1 << 16),
    st.integers(0, 4),
    st.sampled_from([0, 1, 16, 64]),
    st.sampled_from(DTYPES),
    st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(blocks)
def test_block_response_fast_path_is_the_protobuf_encoding_and_decodes_in_place(b):
    data = wire.encode_block_response(b)
    assert data == wire.block_to_pb(b).SerializeToString()
    got = wire.decode_response(data)
    assert isinstance(got, Block)
    assert (got.layer, got.start, got.end, got.index) == (b.layer, b.start, b.end, b.index)
    for a, c in ((got.key, b.key), (got.value, b.value)):
        assert a.dtype == c.dtype and tuple(a.shape) == tuple(c.shape)
        assert torch.equal(a, c)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.booleans()), min_size=1, max_size=4),
    st.integers(0, 3),
    st.sampled_from([1, 16, 64, 4096]),
    st.sampled_from(DTYPES),
)
def test_block_parts_encode_as_the_block_of_their_join(parts, heads, dim, dtype):
    """A block given as consecutive token ranges (a layer's lane pieces) makes the message of one Block holding
    their join along tokens: the same bytes, with no join in torch. Parts may be token-range views, or empty."""
    keys = [make_tensor((heads, n, dim), dtype, i, strided) for i, (n, strided) in enumerate(parts)]
    values = [make_tensor((heads, n, dim), dtype, 10 + i, strided) for i, (n, strided) in enumerate(parts)]
    n = sum(p for p, _ in parts)
    joined = Block(3, 5, 5 + n, 2, torch.cat(keys, 1), torch.cat(values, 1))
    b = BlockParts(3, 5, 5 + n, 2, keys, values)
    assert (
        wire.encode_block_response(b)
        == wire.encode_block_response(joined)
        == wire.block_to_pb(joined).SerializeToString()
    )
    assert b.nbytes == joined.nbytes


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 64),
    st.sampled_from("kv"),
    st.integers(0, 5000),
    st.integers(1, 40),
    st.sampled_from(DTYPES),
    st.booleans(),
)
def test_chunk_request_fast_path_is_the_protobuf_encoding(layer, kind, start, n, dtype, strided):
    c = Chunk(layer, kind, start, start + n, make_tensor((2, n, 32), dtype, 3, strided))
    data = wire.encode_chunk_request(c)
    assert data == wire.chunk_to_pb(c).SerializeToString()
    back = wire.chunk_from_pb(pb.TranslateRequest.FromString(data).chunk)
    assert torch.equal(back.tensor, c.tensor)


@pytest.mark.parametrize(
    "shape, cut", [((3, 8192, 64), (2730, 5460)), ((2, 4096, 16), (0, 4000)), ((5, 4, 4096, 8), (1, 3))]
)
def test_slices_that_are_each_contiguous_encode_as_protobuf_does(shape, cut):
    """A token range of [heads, tokens, head_dim] is no contiguous tensor, but each head's slice is: those slices are
    joined into the message straight from the tensor (large enough ones; small ones are copied first)."""
    full = torch.randn(*shape)
    t = full[:, cut[0] : cut[1]] if full.dim() == 3 else full[:, cut[0] : cut[1]].transpose(0, 1)
    assert not t.is_contiguous()
    c = Chunk(1, "v", 0, t.shape[1], t)
    assert wire.encode_chunk_request(c) == wire.chunk_to_pb(c).SerializeToString()
    b = Block(2, 0, t.shape[1], 0, t, t)
    assert wire.encode_block_response(b) == wire.block_to_pb(b).SerializeToString()
    assert torch.equal(wire.decode_response(wire.encode_block_response(b)).value, t)


def _as_frame(msg):
    return msg if isinstance(msg, wire.ChunkFrame) else wire.frame_from_pb(msg.chunk)  # protobuf's own parse


def _frame_tuple(f: wire.ChunkFrame):
    return (f.layer, f.kind, f.start, f.end, f.dtype, f.shape, bytes(f.data))


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 64),
    st.sampled_from("kv"),
    st.integers(0, 5000),
    st.integers(0, 40),
    st.sampled_from(DTYPES),
    st.booleans(),
)
def test_chunk_requests_are_read_in_place(layer, kind, start, n, dtype, strided):
    """The sidecar's request parse: a canonical chunk becomes a frame whose data is a view of the received bytes
    (no copy), holding exactly what protobuf reads from the same bytes."""
    import ctypes

    c = Chunk(layer, kind, start, start + n, make_tensor((2, n, 32), dtype, 3, strided))
    data = wire.encode_chunk_request(c)
    got = wire.decode_request(data)
    assert isinstance(got, wire.ChunkFrame)
    assert _frame_tuple(got) == _frame_tuple(_as_frame(pb.TranslateRequest.FromString(data)))
    t = wire.chunk_from_frame(got, (2, n, 32), dtype).tensor
    assert torch.equal(t, c.tensor)
    if n:
        base = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
        assert base <= t.data_ptr() < base + len(data)  # the tensor views the message


def _chunk_msg(**fields) -> pb.TranslateRequest:
    return pb.TranslateRequest(chunk=pb.SourceChunk(**fields))


TENSOR = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 2, 2], data=bytes(range(16)))
ODD_CHUNKS = [
    _chunk_msg(layer=2, kind=pb.KV_KIND_VALUE, token_start=4, token_end=6, tensor=TENSOR).SerializeToString()
    + _chunk_msg(layer=3).SerializeToString(),  # merged twice: protobuf's merge semantics
    _chunk_msg(layer=1, token_end=2, tensor=TENSOR).SerializeToString()
    + b"\x78\x05",  # an unknown field, outer message
    b"\x12\x0c\x08\x01\x20\x02\x2a\x06\x08\x01\x10\x01\x10\x02",  # an unpacked repeated shape
    b"\x12\x08\x08\x80\x80\x80\x80\x10\x20\x01",  # a layer past uint32 (protobuf truncates it)
    b"\x12\x06\x10\xff\xff\xff\xff\x0f",  # a negative enum value
    b"\x12\x09\x2a\x07\x12\x05\x80\x80\x80\x80\x10",  # a shape entry past uint32
]


MALFORMED = [
    b"\x12\x08\x2a\x06\x12\x02\x03\x88\x1a\x00",  # a packed shape whose last varint runs into the data field
    b"\x12\x06\x2a\x02\x08\x80\x08\x01",  # the tensor's dtype varint runs past the tensor into the chunk
]


@pytest.mark.parametrize("data", MALFORMED)
def test_malformed_chunks_are_refused_as_protobuf_refuses_them(data):
    from google.protobuf.message import DecodeError

    with pytest.raises(DecodeError):
        pb.TranslateRequest.FromString(data)
    with pytest.raises(DecodeError):
        wire.decode_request(data)


@pytest.mark.parametrize(
    "data",
    [
        b"\x12\x00",  # an empty chunk (what protobuf writes for SourceChunk())
        b"\x12\x04\x20\x01\x08\x05",  # distinct fields out of order: the same message to protobuf
    ],
)
def test_other_encodings_read_in_place_read_as_protobuf_reads_them(data):
    got = wire.decode_request(data)
    assert isinstance(got, wire.ChunkFrame) and isinstance(got.data, memoryview)
    assert _frame_tuple(got) == _frame_tuple(_as_frame(pb.TranslateRequest.FromString(data)))


@pytest.mark.parametrize("data", ODD_CHUNKS)
def test_chunks_in_any_other_form_are_read_by_protobuf(data):
    got = wire.decode_request(data)
    assert isinstance(got, wire.ChunkFrame) and isinstance(got.data, bytes)  # a frame, from protobuf's parse
    assert _frame_tuple(got) == _frame_tuple(_as_frame(pb.TranslateRequest.FromString(data)))


def test_other_responses_and_non_canonical_blocks_go_through_protobuf():
    header = wire.info_to_pb(
        wire.TargetInfo("m", "1.0.0", "llama", 2, 2, 16, "f" * 64, "contiguous", 0, torch.float32, 8, 0)
    )
    assert isinstance(wire.decode_response(header.SerializeToString()), pb.TranslateResponse)
    b = Block(1, 0, 4, 0, make_tensor((2, 4, 16), torch.float32), make_tensor((2, 4, 16), torch.float32))
    msg = wire.block_to_pb(b)
    unusual = (
        msg.SerializeToString() + pb.TranslateResponse(block=pb.TargetBlock(layer=3)).SerializeToString()
    )  # merged twice
    got = wire.decode_response(unusual)
    assert isinstance(got, pb.TranslateResponse) and got.block.layer == 3  # protobuf's merge semantics, not ours
    bad_size = pb.TranslateResponse(block=pb.TargetBlock(layer=1, key=pb.Tensor(dtype=1, shape=[2, 2], data=b"x" * 3)))
    got = wire.decode_response(bad_size.SerializeToString())
    assert isinstance(got, pb.TranslateResponse)
    with pytest.raises(wire.InvalidInput, match="3 bytes"):
        wire.block_from_pb(got.block)
    from google.protobuf.message import DecodeError

    with pytest.raises(DecodeError):
        wire.decode_response(b"\x12\xff\xff")  # truncated: protobuf refuses it too


def test_all_finite_is_exact():
    """The sidecar's NaN/Inf check takes a fast path (a finite sum proves every element finite); huge finite values
    whose sum overflows must still pass, and one NaN or Inf anywhere must still fail, in every wire dtype."""
    from kvferry.sidecar.pipeline import all_finite

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(3, 64, 16).to(dtype)
        assert all_finite(x)
        huge = torch.full((3, 64, 16), torch.finfo(dtype).max, dtype=dtype)
        assert all_finite(huge) and all_finite(-huge)  # the sum overflows; the elements are finite
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[2, 63, 15] = bad
            assert not all_finite(y), (dtype, bad)
        mixed = torch.cat([huge[:1], -huge[:1]])
        mixed[0, 0, 0] = float("nan")
        assert not all_finite(mixed)


def test_the_fast_codec_takes_its_field_numbers_from_translate_proto():
    """fastwire writes no field number of its own: each is the generated descriptor's, so a renumbered field in
    translate.proto moves the fast path with it (and the golden wire files then fail, as they must)."""
    from kvferry.common import fastwire as f

    assert pb.TranslateRequest(header=pb.TranslateHeader(num_tokens=1)).SerializeToString()[:1] == f.REQUEST_HEADER_TAG
    assert pb.TranslateRequest(chunk=pb.SourceChunk(layer=1)).SerializeToString()[:1] == f.REQUEST_CHUNK_TAG
    assert pb.TranslateResponse(block=pb.TargetBlock(layer=1)).SerializeToString()[:1] == f.RESPONSE_BLOCK_TAG
    for message, names, numbers in (
        (
            pb.SourceChunk,
            ("layer", "kind", "token_start", "token_end", "tensor"),
            (f.C_LAYER, f.C_KIND, f.C_START, f.C_END, f.C_TENSOR),
        ),
        (
            pb.TargetBlock,
            ("layer", "token_start", "token_end", "block_index", "key", "value"),
            (f.B_LAYER, f.B_START, f.B_END, f.B_INDEX, f.B_KEY, f.B_VALUE),
        ),
        (pb.Tensor, ("dtype", "shape", "data", "region_offset"), (f.T_DTYPE, f.T_SHAPE, f.T_DATA, f.T_REGION_OFFSET)),
    ):
        assert numbers == tuple(message.DESCRIPTOR.fields_by_name[n].number for n in names)
    source = Path(f.__file__).read_text()
    assert 'b"\\x' not in source and "_scalar(1" not in source  # no byte-literal tags, no literal field numbers
