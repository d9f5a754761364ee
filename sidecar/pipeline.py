"""The streaming translate pipeline: validate chunks, map layers as their sources complete, cut blocks.

Plain Python over torch; no gRPC. The servicer feeds it chunks and sends what it returns, so a
target layer leaves as soon as its source layers have arrived and memory stays bounded.
"""

from __future__ import annotations

import time

import torch

from kvferry.client.messages import PAGED, Block, Chunk, Stats, TargetInfo, TranslateSpec
from kvferry.mappings.apply import StreamingApplier
from kvferry.mappings.artifact import MapSet
from kvferry.mappings.errors import Incompatible, InvalidInput

from .limits import Limits


def check_spec(spec: TranslateSpec, ms: MapSet, limits: Limits) -> None:
    """Header-level checks: fingerprints, sizes, layout. Raises before any allocation."""
    sg = ms.source.geometry
    if spec.source_geometry and spec.source_geometry != sg.fingerprint:
        raise Incompatible(f"source geometry fingerprint {spec.source_geometry[:12]}… does not match map {ms.name} "
                           f"{ms.version} (fitted on {ms.source.name}, {sg.fingerprint[:12]}…); use the map for your model")
    if spec.tokenizer and spec.tokenizer != ms.source.tokenizer:
        raise Incompatible(f"tokenizer fingerprint does not match map {ms.name} {ms.version}: the source model tokenizes "
                           "differently from the one the map was fitted on")
    if spec.num_tokens < 1:
        raise InvalidInput("header.num_tokens must be >= 1")
    if spec.token_ids and len(spec.token_ids) != spec.num_tokens:
        raise InvalidInput(f"header has {len(spec.token_ids)} token_ids for num_tokens={spec.num_tokens}")
    if spec.start_position + spec.num_tokens > (sg.rope.max_position_embeddings or 1 << 31):
        raise InvalidInput(f"positions up to {spec.start_position + spec.num_tokens} exceed the source model's "
                           f"max_position_embeddings ({sg.rope.max_position_embeddings})")
    if spec.layout == PAGED and not 1 <= spec.block_size <= limits.max_block_size:
        raise InvalidInput(f"block_size must be in [1, {limits.max_block_size}] for the paged layout")
    elem = torch.empty((), dtype=spec.source_dtype).element_size()
    limits.check(spec.num_tokens, spec.num_tokens * sg.layers * 2 * sg.kv_width * elem)


class TranslateSession:
    """One request's state: per (layer, kind) the next expected token, buffered chunks, the applier.

    ``cached``: target KV for the first tokens, found in the prefix store ([1, kv_heads, m, head_dim]
    per target layer); those tokens are not mapped again. ``expect_chunks=False`` for requests whose
    source KV came from the store. ``keep_output`` retains the full target layers (for write-back).
    """

    def __init__(self, spec: TranslateSpec, ms: MapSet, limits: Limits, cached: list | None = None,
                 expect_chunks: bool = True, keep_output: bool = False):
        check_spec(spec, ms, limits)
        self.spec, self.ms = spec, ms
        self.out_dtype = spec.target_dtype or spec.source_dtype
        self.cached = cached or None
        self.skip = int(cached[0][0].shape[2]) if cached else 0
        self.expect_chunks = expect_chunks
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = {} if keep_output else None
        self.applier = (StreamingApplier(ms, positions=spec.start_position + self.skip, out_dtype=self.out_dtype)
                        if self.skip < spec.num_tokens else None)
        self._next: dict[tuple[int, str], int] = {}
        self._parts: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.stats = Stats(tokens=spec.num_tokens)
        self._t0 = time.perf_counter()

    def initial_blocks(self) -> list[Block]:
        """Blocks that need no source data: everything, when the store covered every token."""
        if self.applier is not None or not self.cached:
            return []
        out = []
        for t, (k, v) in enumerate(self.cached):
            out += self._emit(t, k.to(self.out_dtype), v.to(self.out_dtype))
        return out

    def info(self) -> TargetInfo:
        g = self.ms.target.geometry
        return TargetInfo(self.ms.name, self.ms.version, g.architecture, g.layers, g.kv_heads, g.head_dim, g.fingerprint,
                          self.spec.layout, self.spec.block_size, self.out_dtype, self.spec.num_tokens, self.spec.start_position)

    def expected_shape(self, layer_tokens: int) -> tuple[int, int, int]:
        g = self.ms.source.geometry
        return (g.kv_heads, layer_tokens, g.head_dim)

    def check_chunk_header(self, layer: int, kind: str, start: int, end: int) -> None:
        """Order and range checks, before the chunk's bytes are decoded."""
        g = self.ms.source.geometry
        if not self.expect_chunks:
            raise InvalidInput("this request names a prefix_key: its source KV comes from the prefix store; send no chunks")
        if not 0 <= layer < g.layers:
            raise InvalidInput(f"chunk layer {layer} out of range: the source model has {g.layers} layers")
        nxt = self._next.get((layer, kind), 0)
        if nxt >= self.spec.num_tokens:
            raise InvalidInput(f"layer {layer} {kind.upper()} already received all {self.spec.num_tokens} tokens")
        if start != nxt:
            raise InvalidInput(f"chunks out of order: layer {layer} {kind.upper()} expected token_start {nxt}, got {start}")
        if not start < end <= self.spec.num_tokens:
            raise InvalidInput(f"chunk layer {layer} {kind.upper()} token range [{start}, {end}) is empty or past "
                               f"num_tokens={self.spec.num_tokens}")

    def add(self, chunk: Chunk) -> list[Block]:
        """Take one decoded chunk; return the target blocks it completed (possibly none)."""
        self.check_chunk_header(chunk.layer, chunk.kind, chunk.start, chunk.end)
        want = self.expected_shape(chunk.end - chunk.start)
        if tuple(chunk.tensor.shape) != want:
            raise InvalidInput(f"chunk layer {chunk.layer} {chunk.kind.upper()}: shape {list(chunk.tensor.shape)}, expected {list(want)}")
        if chunk.tensor.dtype != self.spec.source_dtype:
            raise InvalidInput(f"chunk layer {chunk.layer} {chunk.kind.upper()}: dtype {chunk.tensor.dtype} but the header "
                               f"declared {self.spec.source_dtype}")
        key = (chunk.layer, chunk.kind)
        self.stats.bytes_in += chunk.tensor.numel() * chunk.tensor.element_size()
        self._parts.setdefault(key, []).append(chunk.tensor)
        self._next[key] = chunk.end
        if chunk.end < self.spec.num_tokens:
            return []
        parts = self._parts.pop(key)
        if self.applier is None:
            return []  # the prefix store covered every token; the chunks were only validated
        full = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))[None, :, self.skip :]
        t0 = time.perf_counter()
        blocks = []
        for layer, k, v in self.applier.push(chunk.layer, chunk.kind, full):
            if self.cached:
                ck, cv = self.cached[layer]
                k, v = torch.cat([ck.to(k.dtype), k], 2), torch.cat([cv.to(v.dtype), v], 2)
            blocks.extend(self._emit(layer, k, v))
        self.stats.compute_seconds += time.perf_counter() - t0
        return blocks

    def _emit(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> list[Block]:
        if self.outputs is not None:
            self.outputs[layer] = (k, v)
        return self._cut(layer, k[0], v[0])

    def _cut(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> list[Block]:
        n = self.spec.num_tokens
        if self.spec.layout != PAGED:
            out = [Block(layer, 0, n, 0, k, v)]
        else:
            bs = self.spec.block_size
            out = []
            for i, s in enumerate(range(0, n, bs)):
                e = min(s + bs, n)
                kb = k.new_zeros(bs, k.shape[0], k.shape[2])
                vb = v.new_zeros(bs, v.shape[0], v.shape[2])
                kb[: e - s] = k[:, s:e].transpose(0, 1)
                vb[: e - s] = v[:, s:e].transpose(0, 1)
                out.append(Block(layer, s, e, i, kb, vb))
        for b in out:
            self.stats.bytes_out += 2 * b.key.numel() * b.key.element_size()
        self.stats.blocks += len(out)
        return out

    def finish(self) -> Stats:
        """Call when the request stream ends; raises if any layer is incomplete."""
        g = self.ms.source.geometry
        incomplete = any(self._next.get((l, k), 0) < self.spec.num_tokens for l in range(g.layers) for k in "kv")
        if self.expect_chunks and incomplete:
            missing = [f"{l}{k.upper()}" for l in range(g.layers) for k in "kv" if self._next.get((l, k), 0) < self.spec.num_tokens]
            raise InvalidInput(f"truncated stream: source layers {', '.join(missing[:8])}{'…' if len(missing) > 8 else ''} "
                               f"did not receive all {self.spec.num_tokens} tokens")
        self.stats.wall_seconds = time.perf_counter() - self._t0
        return self.stats
