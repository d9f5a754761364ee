"""Plain, typed messages of a translation: what crosses the wire, without protobuf in sight.

Client and sidecar both build and read these; :mod:`kvferry.common.wire` converts them to and
from the kvferry.v1 protobuf messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvferry.common.errors import InvalidInput

CONTIGUOUS = "contiguous"
PAGED = "paged"
ALL_PAGES = 2**32 - 1
"""TranslateSpec.pages_per_block asking for as many pages a block as fit one message (uint32's largest value)."""


@dataclass(frozen=True)
class TranslateSpec:
    """The request header."""

    map_name: str
    map_version: str = ""  # empty: the newest servable version ("latest")
    source_geometry: str = ""
    tokenizer: str = ""
    num_tokens: int = 0
    start_position: int = 0
    token_ids: tuple[int, ...] = ()
    source_dtype: torch.dtype = torch.float32
    layout: str = CONTIGUOUS
    block_size: int = 16
    target_dtype: torch.dtype | None = None
    prefix_key: str = ""
    tenant: str = ""
    pages_per_block: int = 0  # paged: the most pages a block may carry; 0: one page a block, three-dimensional
    response_region: str = ""  # a SharedRegion's name: the file the response's tensor bytes may go into ("": none)
    response_region_bytes: int = 0  # its size
    response_region_key: bytes = b""  # the 32 bytes the caller wrote into the region's header for this call


@dataclass
class Chunk:
    """One source layer's K or V for tokens [start, end): tensor [kv_heads, end - start, head_dim]."""

    layer: int
    kind: str  # "k" or "v"
    start: int
    end: int
    tensor: torch.Tensor


@dataclass
class Block:
    """Target KV for one layer and token range.

    Contiguous: key/value [kv_heads, tokens, head_dim]. Paged: [pages, block_size, kv_heads, head_dim], ``index``
    the first page's, zero-padded past ``end`` (on the wire, a sidecar asked for one page a block, or older than
    pages_per_block, sends [block_size, kv_heads, head_dim]; the client reads that as one page).
    """

    layer: int
    start: int
    end: int
    index: int
    key: torch.Tensor
    value: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together."""
        return 2 * self.key.numel() * self.key.element_size()


@dataclass
class BlockParts:
    """A contiguous block given as consecutive token ranges of one target layer (the lanes' pieces of it), joined
    along tokens only as it is written into its response message: one copy, no torch.cat, one message where the
    pieces would each take one. ``keys``/``values``: [kv_heads, tokens_i, head_dim] each, in token order, together
    covering [start, end)."""

    layer: int
    start: int
    end: int
    index: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together."""
        return 2 * sum(k.numel() * k.element_size() for k in self.keys)


@dataclass
class BlockBytes:
    """A contiguous block whose tensors are given as byte pieces, to be joined once, into the response message:
    a cached prefix sent straight from its stored blobs. ``key``/``value``: pieces whose concatenation is the
    [kv_heads, end - start, head_dim] tensor in C order (little-endian ``dtype``)."""

    layer: int
    start: int
    end: int
    index: int
    dtype: torch.dtype
    shape: tuple[int, int, int]
    key: list
    value: list

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together."""
        h, t, d = self.shape
        return 2 * h * t * d * self.dtype.itemsize


@dataclass(frozen=True)
class TargetInfo:
    """The response header: what the request resolved to."""

    map_name: str
    map_version: str
    architecture: str
    layers: int
    kv_heads: int
    head_dim: int
    geometry: str
    layout: str
    block_size: int
    dtype: torch.dtype
    num_tokens: int
    start_position: int
    pages_per_block: int = 0
    """Paged: the most pages a block carries (0: one page a block, in the three-dimensional wire form)."""
    response_region: bool = False
    """The sidecar took the request's response region: tensors sent with a region offset lie there."""


@dataclass
class Stats:
    """The response trailer."""

    tokens: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    compute_seconds: float = 0.0
    wall_seconds: float = 0.0
    blocks: int = 0
    cached_blocks: int = 0
    extra: dict = field(default_factory=dict)


def check_token_ids(count: int, num_tokens: int) -> None:
    """token_ids, when given, carry one id per token: the one rule for the wire decoder and the pipeline."""
    if count and count != num_tokens:
        raise InvalidInput(f"header has {count} token_ids for num_tokens={num_tokens}; send one id per token")
