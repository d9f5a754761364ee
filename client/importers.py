"""Engine importers: put translated target KV into an HF DynamicCache, a paged KV pool, vLLM's CPU cache or the paged
layout of vLLM's GPU attention backends (FlashAttention's)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvferry.common.errors import InvalidInput, TooLarge
from kvferry.common.messages import Block

# the HF importer, re-exported: one implementation, shared with the offline lab
from kvferry.mappings.cache import to_dynamic_cache as to_dynamic_cache

LayerKV = tuple[torch.Tensor, torch.Tensor]


def contiguous_layers(blocks: list[Block], layers: int, tokens: int | None = None) -> list[LayerKV]:
    """Contiguous blocks (one or more token ranges per layer) -> per layer (K, V) [1, kv_heads, tokens, head_dim]."""
    by_layer: dict[int, list[Block]] = {}
    for b in blocks:
        by_layer.setdefault(b.layer, []).append(b)
    missing = [l for l in range(layers) if l not in by_layer]
    if missing:
        raise InvalidInput(f"translation is missing target layers {missing}")
    out = []
    for l in range(layers):
        parts = sorted(by_layer[l], key=lambda b: b.start)
        pos = 0
        for b in parts:
            if b.start != pos:
                raise InvalidInput(f"target layer {l}: blocks leave a gap or overlap at token {pos}")
            pos = b.end
        if tokens is not None and pos != tokens:
            raise InvalidInput(f"target layer {l} covers {pos} tokens, expected {tokens}")
        if len(parts) == 1:
            out.append((parts[0].key[None], parts[0].value[None]))
        else:
            out.append((torch.cat([b.key for b in parts], 1)[None], torch.cat([b.value for b in parts], 1)[None]))
    return out


def vllm_cpu_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views [blocks, kv_heads, block_size, head_dim] of one layer of vLLM's CPU cache.

    The layer is [blocks, kv_heads, block_size, 2 * head_dim]; per block and head its memory holds the keys
    dims-major ([head_dim, block_size]: the kernel reads one dim across tokens) and then the values token-major
    ([block_size, head_dim]), so the K view is strided. Checked against the HF model's own cache in
    tests/test_vllm.py."""
    nb, heads, bs, width = kv_cache.shape
    d = width // 2
    halves = kv_cache.view(nb, heads, 2, bs * d)
    return halves[:, :, 0].view(nb, heads, d, bs).transpose(2, 3), halves[:, :, 1].view(nb, heads, bs, d)


def flash_attention_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views [blocks, kv_heads, block_size, head_dim] of one layer of the paged cache vLLM's GPU attention
    backends use (FlashAttention's): [2, num_blocks, block_size, num_kv_heads, head_size], K then V, token-major in a
    block. The views are strided (no copy); ``write_pages`` writes through them."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise InvalidInput(
            f"expected a [2, num_blocks, block_size, num_kv_heads, head_size] layer, got {tuple(kv_cache.shape)}"
        )
    return kv_cache[0].transpose(1, 2), kv_cache[1].transpose(1, 2)


def write_pages(
    block: Block, k_pages: torch.Tensor, v_pages: torch.Tensor, table: list[int] | torch.Tensor, from_token: int = 0
) -> None:
    """A contiguous block (key/value [kv_heads, tokens, head_dim], any token range) into paged K and V caches viewed
    as [pages, kv_heads, page_size, head_dim] (vLLM's CPU cache, as its connector views it): token t goes to page
    ``table[t // page_size]``, slot ``t % page_size``. Tokens before ``from_token`` are skipped (the engine has them
    already). One indexed write per tensor, cast to the cache's dtype; the views may be strided."""
    start = max(block.start, from_token)
    if start >= block.end:
        return
    page, table = k_pages.shape[2], torch.as_tensor(table)
    if (block.end - 1) // page >= len(table):
        raise InvalidInput(
            f"tokens up to {block.end} need {(block.end - 1) // page + 1} pages of {page}; the block table "
            f"has {len(table)}"
        )
    tokens = torch.arange(start, block.end)
    pages = table[tokens // page]
    if int(pages.max()) >= k_pages.shape[0] or int(pages.min()) < 0:
        raise InvalidInput(f"the block table names pages outside the cache ({k_pages.shape[0]} pages)")
    slots = tokens % page
    k_pages[pages, :, slots] = block.key[:, start - block.start :].transpose(0, 1).to(k_pages.dtype)
    v_pages[pages, :, slots] = block.value[:, start - block.start :].transpose(0, 1).to(v_pages.dtype)


def read_pages(
    k_pages: torch.Tensor, v_pages: torch.Tensor, table: list[int] | torch.Tensor, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [start, end) out of paged K and V caches viewed as [pages, kv_heads, page_size, head_dim] (the
    inverse of ``write_pages``): copies K and V [kv_heads, end - start, head_dim]."""
    page, table = k_pages.shape[2], torch.as_tensor(table)
    if not 0 <= start < end or (end - 1) // page >= len(table):
        raise InvalidInput(f"tokens [{start}, {end}) are not all in a block table of {len(table)} pages of {page}")
    tokens = torch.arange(start, end)
    pages, slots = table[tokens // page], tokens % page
    return k_pages[pages, :, slots].transpose(0, 1).clone(), v_pages[pages, :, slots].transpose(0, 1).clone()


@dataclass
class PagedKVPool:
    """A vLLM-style paged KV pool: per layer a tensor [num_blocks, 2, block_size, kv_heads, head_dim]."""

    layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    pools: list[torch.Tensor] = field(init=False)
    _free: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.pools = [
            torch.zeros(
                self.num_blocks, 2, self.block_size, self.kv_heads, self.head_dim, dtype=self.dtype, device=self.device
            )
            for _ in range(self.layers)
        ]
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def allocate(self, tokens: int) -> list[int]:
        """A block table for ``tokens`` tokens (physical block ids, in logical order)."""
        need = -(-tokens // self.block_size)
        if need > len(self._free):
            raise TooLarge(f"need {need} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(need)]

    def free(self, table: list[int]) -> None:
        self._free.extend(reversed(table))

    def write(self, blocks: list[Block], table: list[int]) -> None:
        """Write paged blocks ([pages, block_size, kv_heads, head_dim], block.index the first page's logical index)
        into the physical blocks of ``table``: one indexed copy per block and tensor."""
        page = (self.block_size, self.kv_heads, self.head_dim)
        for b in blocks:
            if b.key.dim() != 4 or tuple(b.key.shape[1:]) != page:
                raise InvalidInput(
                    f"block shape {tuple(b.key.shape)} is not [pages, {', '.join(map(str, page))}] of this "
                    f"pool; request block_size={self.block_size}"
                )
            if not 0 <= b.index <= b.index + b.key.shape[0] <= len(table):
                raise InvalidInput(
                    f"pages {b.index}..{b.index + b.key.shape[0] - 1} fall outside the block table "
                    f"({len(table)} blocks)"
                )
            phys = torch.as_tensor(table[b.index : b.index + b.key.shape[0]], device=self.device)
            self.pools[b.layer][:, 0].index_copy_(0, phys, b.key.to(self.dtype))
            self.pools[b.layer][:, 1].index_copy_(0, phys, b.value.to(self.dtype))

    def gather(self, table: list[int], tokens: int) -> list[LayerKV]:
        """Read the first ``tokens`` tokens back as per layer (K, V) [1, kv_heads, tokens, head_dim]."""
        idx = torch.tensor(table, device=self.device)
        out = []
        for pool in self.pools:
            kv = pool.index_select(0, idx)  # [n, 2, bs, H, D]
            k = kv[:, 0].reshape(-1, self.kv_heads, self.head_dim)[:tokens].transpose(0, 1)[None]
            v = kv[:, 1].reshape(-1, self.kv_heads, self.head_dim)[:tokens].transpose(0, 1)[None]
            out.append((k, v))
        return out
