"""Tensors on the wire: dtype codes, a tensor's bytes (copied once, or viewed as pieces for one join), and tensors
viewing received bytes after their dtype, shape and length are checked."""

from __future__ import annotations

import warnings

import torch

from kvferry.common.errors import InvalidInput
from kvferry.v1 import translate_pb2 as pb

_TO_PB = {torch.float32: pb.DTYPE_FLOAT32, torch.float16: pb.DTYPE_FLOAT16, torch.bfloat16: pb.DTYPE_BFLOAT16}


FROM_PB = {v: k for k, v in _TO_PB.items()}


_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


KIND_TO_PB = {"k": pb.KV_KIND_KEY, "v": pb.KV_KIND_VALUE}


KIND_FROM_PB = {v: k for k, v in KIND_TO_PB.items()}


def dtype_to_pb(dtype: torch.dtype) -> int:
    try:
        return _TO_PB[dtype]
    except KeyError:
        raise InvalidInput(f"dtype {dtype} is not supported on the wire; use float32, float16 or bfloat16") from None


def dtype_from_pb(code: int) -> torch.dtype:
    try:
        return FROM_PB[code]
    except KeyError:
        raise InvalidInput(f"dtype code {code} is not one of float32, float16, bfloat16") from None


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype))


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_ITEMSIZE = {d: torch.empty((), dtype=d).element_size() for d in _NAMES}
# Tensors here view received, read-only bytes and are never written: torch's warning about that is noise. Silenced
# for this module only, once (a catch_warnings block per tensor cost more than the parse itself).


warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=__name__)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements in C order as bytes: one copy, straight from a strided view (no .contiguous() first)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy().tobytes()


MIN_PIECE = 16 << 10  # below this a slice costs the join more in Python than copying it twice does


def tensor_pieces(t: torch.Tensor) -> list:
    """The tensor's bytes in C order, as pieces for one join: a view of a contiguous CPU tensor, or one view per
    slice along the first dimension when each slice is contiguous (a token range of [heads, tokens, head_dim]: the
    join is then the only copy), else tensor_bytes (a copy, then the join's)."""
    t = t.detach()
    if t.device.type != "cpu":
        return [tensor_bytes(t)]
    if t.is_contiguous():
        return [_view(t)]
    if t.dim() > 1 and t[0].is_contiguous() and t[0].nbytes >= MIN_PIECE:  # every slice has the first one's strides
        return [_view(s) for s in t.unbind(0)]
    return [tensor_bytes(t)]


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(_SAME_SIZE_INT[t.element_size()]).numpy()).cast("B")


def encode_tensor(t: torch.Tensor) -> pb.Tensor:
    return pb.Tensor(dtype=dtype_to_pb(t.dtype), shape=list(t.shape), data=tensor_bytes(t))


def decode_tensor(
    msg: pb.Tensor,
    expect_shape: tuple[int, ...] | None = None,
    expect_dtype: torch.dtype | None = None,
    what: str = "tensor",
) -> torch.Tensor:
    """Bytes -> tensor, checking dtype, shape and byte count before touching the data."""
    # each read of a bytes field copies it: read it once, here
    return checked_tensor(msg.dtype, tuple(msg.shape), msg.data, expect_shape, expect_dtype, what)


def checked_tensor(
    code: int,
    shape: tuple[int, ...],
    data,
    expect_shape: tuple[int, ...] | None = None,
    expect_dtype: torch.dtype | None = None,
    what: str = "tensor",
) -> torch.Tensor:
    """A tensor viewing ``data`` (no copy), after checking the dtype code, the shape and the byte count."""
    dtype = dtype_from_pb(code)
    shape = tuple(int(s) for s in shape)
    if expect_dtype is not None and dtype != expect_dtype:
        raise InvalidInput(f"{what}: dtype {dtype_name(dtype)} but the header declared {dtype_name(expect_dtype)}")
    if expect_shape is not None and shape != tuple(expect_shape):
        raise InvalidInput(f"{what}: shape {list(shape)}, expected {list(expect_shape)}")
    return view_bytes(data, dtype, shape, what)


def nbytes(dtype: torch.dtype, shape) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``."""
    numel = 1
    for s in shape:
        numel *= int(s)
    return numel * (_ITEMSIZE.get(dtype) or torch.empty((), dtype=dtype).element_size())


def view_bytes(raw, dtype: torch.dtype, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """A tensor viewing ``raw`` (bytes or memoryview; no copy), after checking its length against shape and dtype."""
    want = nbytes(dtype, shape)
    if len(raw) != want:
        raise InvalidInput(f"{what}: {len(raw)} bytes for shape {list(shape)} {dtype_name(dtype)}; expected {want}")
    if want == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).view(shape)  # read-only buffer: never written (warning silenced above)
