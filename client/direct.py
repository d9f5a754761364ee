"""Prefix hits read straight from the store by the client: no sidecar hop on a hit.

A key-only translation whose mapped (target-layout) blocks are all stored needs no compute, so the
client can read them itself: one MGET, checksums verified, tensors viewing the fetched bytes. On any
miss (a block not mapped yet, expired, corrupt) it asks the sidecar, which maps the rest and writes
it back. Only for pods trusted with the deployment's prefix secret and store credentials, which every
pod publishing with ``publish_source`` already holds: on this path no sidecar checks the tenant, the
secret and the store's ACLs do. Maps are honoured as the sidecar reports them (ListMappings): a gated
map is never read directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvferry.common.errors import Unavailable
from kvferry.common.listing import MappingInfo
from kvferry.common.messages import CONTIGUOUS, Block, Stats, TargetInfo
from kvferry.common.prefix import LayerKV, map_id, map_namespaces, model_key
from kvferry.common.prefix_cache import Lookup, PrefixCache

from .client import serving_mapping
from .importers import contiguous_layers


@dataclass(frozen=True)
class DirectHit:
    info: TargetInfo
    blocks: list[Block]  # contiguous blocks, layer by layer, each [kv_heads, tokens, head_dim]
    stats: Stats

    def layers(self) -> list[LayerKV]:
        """Per target layer (K, V) [1, kv_heads, tokens, head_dim]: the blocks joined (one copy)."""
        return contiguous_layers(self.blocks, self.info.layers, self.info.num_tokens)


def _hit_blocks(look: Lookup) -> list[Block]:
    """A full hit's contiguous blocks, layer by layer. In the stored dtype, one block per stored block and layer,
    viewing the fetched bytes: nothing is joined, so an importer copies each block once, straight into its cache
    (``TranslateResult.layers()`` joins them for one that wants whole layers). In another dtype, one block per layer,
    joined and converted (a copy either way)."""
    if not look.as_stored:
        return [Block(i, 0, look.tokens, 0, k[0], v[0]) for i, (k, v) in enumerate(look.layers())]
    views = [b.layers() for b in look.blocks]
    n = look.blocks[0].shape[1] if look.blocks else 0  # one lookup reads its blocks in one shape
    return [
        Block(i, j * n, (j + 1) * n, j, *kv[i])
        for i in range(len(views[0]) if views else 0)
        for j, kv in enumerate(views)
    ]


class DirectReader:
    """Reads a key-only request's mapped blocks from the prefix store when all of them are there."""

    def __init__(self, store, secret: bytes, block_size: int = 256, map_list_ttl: float = 10.0):
        self.cache = PrefixCache(store, secret, block_size)
        self.map_list_ttl = map_list_ttl
        self._maps: list[MappingInfo] = []
        self._maps_at = -1e9
        self.corrupt = 0

    @property
    def maps_stale(self) -> bool:
        """ListMappings is cached for ``map_list_ttl`` seconds: new versions and gate changes show up within it."""
        return time.monotonic() - self._maps_at > self.map_list_ttl

    def set_maps(self, maps: list[MappingInfo]) -> None:
        self._maps, self._maps_at = list(maps), time.monotonic()

    def answer(self, spec) -> DirectHit | None:
        """A full hit for a key-only TranslateSpec, read from the store; None for anything else (a miss, a gated map,
        a fingerprint the sidecar would refuse, the store unreachable): the caller then asks the sidecar."""
        if not spec.prefix_key or spec.layout != CONTIGUOUS:
            return None
        info = serving_mapping(self._maps, spec.map_name, spec.map_version)
        if (
            info is None
            or (spec.source_geometry and spec.source_geometry != info.source.fingerprint)
            or (spec.tokenizer and spec.tokenizer != info.tokenizer_fingerprint)
        ):
            return None
        try:
            return self.read(info, spec.token_ids, spec.prefix_key, spec.tenant, spec.target_dtype)
        except Unavailable:
            return None

    def read(
        self, info: MappingInfo, token_ids, prefix_key: str, tenant: str = "", dtype: torch.dtype | None = None
    ) -> DirectHit | None:
        """The mapped KV up to the block ``prefix_key`` names, if every one of its blocks is stored; else None."""
        t0 = time.perf_counter()
        g = info.target
        src_ns, tgt_ns = map_namespaces(
            tenant,
            model_key(info.source.fingerprint, info.tokenizer_fingerprint),
            model_key(g.fingerprint, info.tokenizer_fingerprint),
            map_id(info.name, info.version, info.content_sha256),
        )
        src_hashes = self.cache.prefix_blocks(src_ns, token_ids, prefix_key)
        if src_hashes is None:
            return None  # the sidecar says why (NOT_FOUND)
        blocks = len(src_hashes)
        tokens = list(token_ids[: blocks * self.cache.block_size])
        stored = info.dtype
        look = self.cache.lookup(tgt_ns, tokens, g.layers, g.kv_heads, g.head_dim, dtype=dtype, stored_dtype=stored)
        self.corrupt += look.corrupt
        if len(look.blocks) < blocks:
            return None
        out = _hit_blocks(look)
        n = len(tokens)
        out_dtype = out[0].key.dtype
        target = TargetInfo(
            info.name,
            info.version,
            g.architecture,
            g.layers,
            g.kv_heads,
            g.head_dim,
            g.fingerprint,
            CONTIGUOUS,
            0,
            out_dtype,
            n,
            0,
        )
        nbytes = sum(2 * b.key.numel() * b.key.element_size() for b in out)
        stats = Stats(
            tokens=n,
            bytes_out=nbytes,
            blocks=len(out),
            cached_blocks=blocks,
            wall_seconds=time.perf_counter() - t0,
            extra={"path": "direct"},
        )
        return DirectHit(target, out, stats)
