"""Prefix-store hits streamed straight out: a key-only request whose mapped blocks are all stored.

The sidecar fetches a few stored blocks at a time, verifies each blob's checksum and sends it as one
TargetBlockGroup message (every layer of the block; the tensor bytes are copied once, from the blob
into the message), while the next blocks are fetched. A block that expired or turned out corrupt
after the existence probe is mapped again from its stored source block and written back; when that
is gone too, the request fails UNAVAILABLE and the client's retry serves the shorter stored prefix.
Plain Python, no gRPC: the servicer sends what ``fetch`` returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvferry.client import wire
from kvferry.client.messages import Block, Stats, TargetInfo, TranslateSpec
from kvferry.client.prefix import LayerKV, Namespace
from kvferry.client.prefix_cache import PrefixCache
from kvferry.client.stores import StoreUnavailable
from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import MapSet
from kvferry.mappings.errors import Unavailable

from .pipeline import target_info


@dataclass
class HitStream:
    spec: TranslateSpec  # covers exactly the stored blocks
    ms: MapSet
    cache: PrefixCache
    tgt_ns: Namespace
    src_ns: Namespace
    tgt_hashes: list[bytes]
    src_hashes: list[bytes]
    dtype: torch.dtype
    batch_blocks: int = 2
    stats: Stats = field(default_factory=Stats)
    remapped: int = 0  # blocks mapped again from their source (vanished or corrupt since the probe)
    corrupt: int = 0
    written: int = 0
    store_errors: int = 0

    def __post_init__(self) -> None:
        self.stats.tokens = self.spec.num_tokens
        self._t0 = time.perf_counter()

    def info(self) -> TargetInfo:
        return target_info(self.spec, self.ms, self.dtype)

    @property
    def batches(self) -> int:
        return -(-len(self.tgt_hashes) // self.batch_blocks)

    def fetch(self, i: int) -> list[bytes]:
        """Batch ``i``'s blocks, each an encoded TargetBlockGroup response message."""
        lo = i * self.batch_blocks
        tg = self.ms.target.geometry
        got = self.cache.fetch(self.tgt_ns, self.tgt_hashes[lo : lo + self.batch_blocks], tg.layers, tg.kv_heads,
                               tg.head_dim, self.dtype)
        self.corrupt += got.corrupt
        return [self._encode(lo + j, layers if layers is not None else self._remap(lo + j))
                for j, layers in enumerate(got.blocks)]

    def finish(self) -> Stats:
        self.stats.cached_blocks = len(self.tgt_hashes) - self.remapped
        self.stats.wall_seconds = time.perf_counter() - self._t0
        return self.stats

    def _encode(self, b: int, layers: list[LayerKV]) -> bytes:
        bs = self.cache.block_size
        blocks = [Block(t, b * bs, (b + 1) * bs, b, k, v) for t, (k, v) in enumerate(layers)]
        self.stats.bytes_out += sum(2 * x.key.numel() * x.key.element_size() for x in blocks)
        self.stats.blocks += len(blocks)
        return wire.encode_block_group(blocks)

    def _remap(self, b: int) -> list[LayerKV]:
        sg, bs = self.ms.source.geometry, self.cache.block_size
        src = self.cache.fetch(self.src_ns, [self.src_hashes[b]], sg.layers, sg.kv_heads, sg.head_dim, self.spec.source_dtype)
        self.corrupt += src.corrupt
        if src.blocks[0] is None:
            raise Unavailable(f"stored prefix block {b} expired or was corrupt during this request, and its source block "
                              "is gone too; retry: the sidecar then serves the shorter prefix it still holds")
        t0 = time.perf_counter()
        mapped = [(k.to(self.dtype), v.to(self.dtype)) for k, v in apply(self.ms, [(k[None], v[None]) for k, v in src.blocks[0]], b * bs)]
        self.stats.compute_seconds += time.perf_counter() - t0
        self.remapped += 1
        try:
            self.written += self.cache.store_blocks(self.tgt_ns, self.tgt_hashes, mapped, b, b + 1, token_offset=b * bs)
        except StoreUnavailable:
            self.store_errors += 1
        return [(k[0], v[0]) for k, v in mapped]
