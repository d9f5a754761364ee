"""Publish and look up prefix blocks in a store (Redis or in-memory), longest prefix first."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from kvferry.common.errors import InvalidInput, Unavailable

from .prefix import CorruptBlock, LayerKV, Namespace, StoredBlock, block_hashes, encode_block, read_block, split_blocks


@dataclass
class Lookup:
    """The longest run of consecutive stored blocks starting at ``start_block``, verified and not yet copied."""

    hashes: list[bytes]  # every full block's hash for the token ids
    start_block: int
    blocks: list[StoredBlock]
    corrupt: int = 0
    dtype: torch.dtype | None = None  # the dtype the caller asked for (None: as stored)

    @property
    def end_block(self) -> int:
        return self.start_block + len(self.blocks)

    @property
    def tokens(self) -> int:
        return sum(b.shape[1] for b in self.blocks)

    @property
    def as_stored(self) -> bool:
        """Whether every found block holds the asked dtype, so its bytes can travel as they are."""
        want = self.dtype or (self.blocks[0].dtype if self.blocks else None)
        return all(b.dtype == want for b in self.blocks)

    def layers(self, token_major: bool = False) -> list[LayerKV]:
        """The found blocks joined per layer (one copy, straight from the blobs' bytes), in the asked dtype:
        (K, V) [1, kv_heads, tokens, head_dim]. ``token_major``: the same tensors viewing memory laid out
        [tokens, kv_heads, head_dim], as paged caches hold them (the transpose done in the join's one pass)."""
        if not self.blocks:
            return []
        want = self.dtype or self.blocks[0].dtype
        if token_major:
            return self._join_token_major(want)
        if self.as_stored:
            return self._join_uniform() or self._join_pieces()
        # another dtype than stored (asked for, or writers that asked for different ones): cast while joining
        cast = self._join_cast(want)
        if cast is not None:
            return cast
        return [
            tuple(torch.cat([b.layer(i)[kind].to(want) for b in self.blocks], 1)[None] for kind in (0, 1))
            for i in range(len(self.blocks[0].offsets))
        ]

    def _laid_out_alike(self) -> bool:
        """Whether every block's tensors tile its payload's start in the same order and shape (``StoredBlock.tiles``):
        then the blocks join as whole arrays, in one call or one a block."""
        first = self.blocks[0]
        return all(b.tiled and b.slots == first.slots and b.shape == first.shape for b in self.blocks)

    def _join_cast(self, want: torch.dtype) -> list[LayerKV] | None:
        """The join and the cast to ``want`` in one pass, a block at a time (each block's tensors copied into the
        output in one call), when the blocks are laid out alike; else None."""
        if not self._laid_out_alike():
            return None
        first = self.blocks[0]
        heads, _, dim = first.shape
        out = torch.empty((2 * len(first.offsets), heads, self.tokens, dim), dtype=want)
        at = 0
        for b in self.blocks:
            n = b.shape[1]
            out[:, :, at : at + n].copy_(b.tiles())
            at += n
        return [(out[k][None], out[v][None]) for k, v in first.slots]

    def _join_token_major(self, want: torch.dtype) -> list[LayerKV]:
        """The join, the cast to ``want`` and the transpose to token-major memory in one pass: a block at a time when
        the blocks are laid out alike, else layer by layer."""
        first = self.blocks[0]
        heads, _, dim = first.shape
        alike = self._laid_out_alike()
        rows = first.slots if alike else tuple((2 * i, 2 * i + 1) for i in range(len(first.offsets)))
        out = torch.empty((2 * len(rows), self.tokens, heads, dim), dtype=want)
        at = 0
        for b in self.blocks:
            n = b.shape[1]
            if alike:
                out[:, at : at + n].copy_(b.tiles().transpose(1, 2))
            else:
                for (k, v), (rk, rv) in zip(b.layers(), rows):
                    out[rk, at : at + n].copy_(k.transpose(0, 1))
                    out[rv, at : at + n].copy_(v.transpose(0, 1))
            at += n
        return [(out[k].transpose(0, 1)[None], out[v].transpose(0, 1)[None]) for k, v in rows]

    def _join_uniform(self) -> list[LayerKV] | None:
        """The join in one numpy call when the blocks (all in one dtype) are laid out alike: one [tensors, kv_heads,
        tokens, row bytes] array whose rows are the layers' K and V, so each layer's K or V is a contiguous view of it.
        None when the blocks differ (the piece-by-piece join)."""
        if not self._laid_out_alike():
            return None
        first = self.blocks[0]
        size, tensors = first.nbytes, 2 * len(first.offsets)
        heads, bs, _ = first.shape
        row = first.row_bytes
        out = torch.empty((tensors, heads, self.tokens, row), dtype=torch.uint8)
        np.concatenate(
            [np.frombuffer(b.data, np.uint8, tensors * size).reshape(tensors, heads, bs, row) for b in self.blocks],
            axis=2,
            out=out.numpy(),
        )
        out = out.view(first.dtype)
        return [(out[k][None], out[v][None]) for k, v in first.slots]

    def _join_pieces(self) -> list[LayerKV]:
        """The join piece by piece (head by head, block by block), for blocks whose layouts differ."""
        heads, _, dim = self.blocks[0].shape
        n, stored = self.tokens, self.blocks[0].dtype
        out = []
        for i in range(len(self.blocks[0].offsets)):
            kv = []
            for kind in (0, 1):
                t = torch.empty((1, heads, n, dim), dtype=stored)
                dst, at = memoryview(t.view(torch.uint8).numpy()).cast("B"), 0
                for piece in self.pieces(i, kind, 0, n):
                    dst[at : at + len(piece)] = piece
                    at += len(piece)
                kv.append(t)
            out.append(tuple(kv))
        return out

    def pieces(self, layer: int, kind: int, start: int, stop: int) -> list[memoryview]:
        """Layer ``layer``'s K (kind 0) or V (kind 1) for found tokens [start, stop), as the stored bytes whose
        concatenation is that [kv_heads, stop - start, head_dim] tensor in C order: head by head, block by block.
        Only for blocks stored in the asked dtype (``as_stored``), which one lookup reads in one shape."""
        if not self.blocks or start >= stop:
            return []
        heads, n, _ = self.blocks[0].shape
        row = self.blocks[0].row_bytes
        stride = n * row  # one head's rows in a block
        spans = []  # per block overlapping [start, stop): (its bytes, first row's offset, span bytes)
        for j in range(start // n, min(-(-stop // n), len(self.blocks))):
            b, lo, hi = self.blocks[j], max(start - j * n, 0), min(stop - j * n, n)
            spans.append((b.data, b.offsets[layer][kind] + lo * row, (hi - lo) * row))
        return [data[base + h * stride : base + h * stride + size] for h in range(heads) for data, base, size in spans]


class PrefixCache:
    def __init__(
        self, store, secret: bytes, block_size: int = 256, ttl: float = 3600.0, max_blob_bytes: int = 64 << 20
    ):
        if block_size < 1 or ttl <= 0:
            raise InvalidInput("prefix block_size must be >= 1 and ttl > 0")
        self.store, self.secret, self.block_size, self.ttl, self.max_blob_bytes = (
            store,
            secret,
            block_size,
            ttl,
            max_blob_bytes,
        )

    def hashes(self, ns: Namespace, token_ids) -> list[bytes]:
        return block_hashes(self.secret, ns, token_ids, self.block_size)

    def prefix_blocks(self, ns: Namespace, token_ids, prefix_key: str) -> list[bytes] | None:
        """The block hashes of ``token_ids`` up to the one ``prefix_key`` names (what publish returned), or None
        when it names none of them."""
        hashes = self.hashes(ns, token_ids)
        tips = [h.hex() for h in hashes]
        return hashes[: tips.index(prefix_key) + 1] if prefix_key in tips else None

    def lookup(
        self,
        ns: Namespace,
        token_ids,
        layers: int,
        kv_heads: int,
        head_dim: int,
        start_block: int = 0,
        dtype: torch.dtype | None = None,
        hashes: list[bytes] | None = None,
        stored_dtype: torch.dtype | None = None,
    ) -> Lookup:
        """Stored blocks from ``start_block`` on, stopping at the first miss; a corrupt blob is a miss, and is
        deleted (best effort) so the next writer stores a good copy: writes never overwrite. ``stored_dtype``: blocks
        are stored in this dtype alone (a map's own precision, whoever asked first); one in another is a miss, and
        deleted too. ``dtype`` is what the caller reads them as."""
        hashes = hashes if hashes is not None else self.hashes(ns, token_ids)
        wanted = hashes[start_block:]
        blobs = self.store.get_many([ns.key(h) for h in wanted]) if wanted else []
        found, corrupt = [], 0
        for h, blob in zip(wanted, blobs):
            if blob is None:
                break
            try:
                block = read_block(blob, h, layers, (kv_heads, self.block_size, head_dim))
                if stored_dtype is not None and block.dtype != stored_dtype:
                    raise CorruptBlock(f"a mapped block stored as {block.dtype}, not the map's {stored_dtype}")
                found.append(block)
            except CorruptBlock:
                corrupt += 1
                with contextlib.suppress(Unavailable):
                    self.store.discard([ns.key(h)])
                break
        return Lookup(hashes, start_block, found, corrupt, dtype)

    def encode_blocks(
        self,
        ns: Namespace,
        hashes: list[bytes],
        layers: list[LayerKV],
        start_block: int,
        end_block: int,
        token_offset: int = 0,
    ) -> list[tuple[str, bytes]]:
        """The (key, blob) items of blocks [start_block, end_block) cut from ``layers`` (which start at token
        ``token_offset``): the tensor work of a write, without its I/O (see ``put``)."""
        bs = self.block_size
        items = []
        for i, block in enumerate(
            split_blocks(layers, start_block * bs - token_offset, end_block * bs - token_offset, bs)
        ):
            h = hashes[start_block + i]
            blob = encode_block(block, h, bs)
            if len(blob) <= self.max_blob_bytes:
                items.append((ns.key(h), blob))
        return items

    def put(self, items: list[tuple[str, bytes]]) -> int:
        """Store encoded blocks (never overwriting); returns how many were new."""
        return self.store.put_many(items, self.ttl)

    def store_blocks(
        self,
        ns: Namespace,
        hashes: list[bytes],
        layers: list[LayerKV],
        start_block: int,
        end_block: int,
        token_offset: int = 0,
    ) -> int:
        """Write blocks [start_block, end_block) cut from ``layers`` (which start at token ``token_offset``)."""
        return self.put(self.encode_blocks(ns, hashes, layers, start_block, end_block, token_offset))

    def publish(self, ns: Namespace, token_ids, layers: list[LayerKV]) -> str:
        """Publish a cache's full blocks; returns the prefix key (hex of the last full block's hash), "" if none."""
        hashes = self.hashes(ns, token_ids)
        if not hashes:
            return ""
        self.store_blocks(ns, hashes, layers, 0, len(hashes))
        return hashes[-1].hex()


def publish_source(
    cache,
    token_ids,
    source_identity,
    *,
    store,
    secret: bytes,
    tenant: str = "default",
    block_size: int = 256,
    ttl: float = 3600.0,
) -> str:
    """Publish a source server's cache (HF cache or list of (K, V)) so sidecars can translate it by key.

    ``store`` is a RedisStore/MemoryStore (see kvferry.common.stores.open_store); ``secret`` and
    ``block_size`` must match the sidecars' prefix_secret and prefix_block_size. Returns the prefix key.
    """
    from kvferry.mappings.cache import cache_layers

    from .prefix import model_id

    layers = cache_layers(cache)
    ids = [int(t) for t in token_ids]
    if layers and int(layers[0][0].shape[-2]) < len(ids) // block_size * block_size:
        raise InvalidInput("the cache covers fewer tokens than the full blocks of token_ids")
    pc = PrefixCache(store, secret, block_size, ttl)
    return pc.publish(Namespace(tenant, model_id(source_identity)), ids, layers)
