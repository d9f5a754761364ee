"""The tensor wire codec: the hand-written fast paths produce and read exactly the protobuf wire format."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.common import wire
from kvferry.common.messages import Block, Chunk
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
        layer, start, start + n, index, make_tensor((heads, n, dim), dtype, 1, strided), make_tensor((heads, n, dim), dtype, 2, strided)),
    st.integers(0, 300), st.integers(0, 1 << 20), st.integers(0, 40), st.integers(0, 1 << 16), st.integers(0, 4),
    st.sampled_from([0, 1, 16, 64]), st.sampled_from(DTYPES), st.booleans())


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
@given(st.integers(0, 64), st.sampled_from("kv"), st.integers(0, 5000), st.integers(1, 40), st.sampled_from(DTYPES), st.booleans())
def test_chunk_request_fast_path_is_the_protobuf_encoding(layer, kind, start, n, dtype, strided):
    c = Chunk(layer, kind, start, start + n, make_tensor((2, n, 32), dtype, 3, strided))
    data = wire.encode_chunk_request(c)
    assert data == wire.chunk_to_pb(c).SerializeToString()
    back = wire.chunk_from_pb(pb.TranslateRequest.FromString(data).chunk)
    assert torch.equal(back.tensor, c.tensor)


def test_other_responses_and_non_canonical_blocks_go_through_protobuf():
    header = wire.info_to_pb(wire.TargetInfo("m", "1.0.0", "llama", 2, 2, 16, "f" * 64, "contiguous", 0, torch.float32, 8, 0))
    assert isinstance(wire.decode_response(header.SerializeToString()), pb.TranslateResponse)
    b = Block(1, 0, 4, 0, make_tensor((2, 4, 16), torch.float32), make_tensor((2, 4, 16), torch.float32))
    msg = wire.block_to_pb(b)
    unusual = msg.SerializeToString() + pb.TranslateResponse(block=pb.TargetBlock(layer=3)).SerializeToString()  # merged twice
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
