"""The streaming translate pipeline: validate chunks, map layers as their sources complete, cut blocks.

Plain Python over torch; no gRPC. The servicer feeds it chunks and sends what it returns, so a
target layer leaves as soon as its source layers have arrived and memory stays bounded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from kvferry.common.errors import Incompatible, InvalidInput
from kvferry.common.messages import (
    PAGED,
    Block,
    BlockBytes,
    BlockParts,
    Chunk,
    Stats,
    TargetInfo,
    TranslateSpec,
    check_token_ids,
)
from kvferry.common.prefix_cache import Lookup
from kvferry.mappings.apply import StreamingApplier
from kvferry.mappings.artifact import MapSet
from kvferry.sidecar.lanes import Lanes

from .limits import Limits


def check_spec(spec: TranslateSpec, ms: MapSet, limits: Limits) -> None:
    """Header-level checks: fingerprints, sizes, layout. Raises before any allocation."""
    sg = ms.source.geometry
    if spec.source_geometry and spec.source_geometry != sg.fingerprint:
        raise Incompatible(
            f"source geometry fingerprint {spec.source_geometry[:12]}… does not match map {ms.name} "
            f"{ms.version} (fitted on {ms.source.name}, {sg.fingerprint[:12]}…); use the map for your model"
        )
    if spec.tokenizer and spec.tokenizer != ms.source.tokenizer:
        raise Incompatible(
            f"tokenizer fingerprint does not match map {ms.name} {ms.version}: the source model tokenizes "
            "differently from the one the map was fitted on"
        )
    if spec.num_tokens < 1:
        raise InvalidInput("header.num_tokens must be >= 1")
    check_token_ids(len(spec.token_ids), spec.num_tokens)
    if spec.start_position + spec.num_tokens > (sg.rope.max_position_embeddings or 1 << 31):
        raise InvalidInput(
            f"positions up to {spec.start_position + spec.num_tokens} exceed the source model's "
            f"max_position_embeddings ({sg.rope.max_position_embeddings})"
        )
    if spec.layout == PAGED and not 1 <= spec.block_size <= limits.max_block_size:
        raise InvalidInput(f"block_size must be in [1, {limits.max_block_size}] for the paged layout")
    elem = torch.empty((), dtype=spec.source_dtype).element_size()
    limits.check(spec.num_tokens, spec.num_tokens * sg.layers * 2 * sg.kv_width * elem)
    per_token = 2 * ms.target.geometry.kv_width * torch.empty((), dtype=target_dtype(spec, ms)).element_size()
    fits = limits.tokens_per_message(per_token)
    if fits < 1 or (spec.layout == PAGED and spec.block_size > fits):
        raise InvalidInput(
            f"a {'page of ' + str(spec.block_size) + ' tokens' if spec.layout == PAGED else 'token'} of target KV "
            f"({per_token} bytes a token) does not fit the sidecar's max_message_bytes "
            f"({limits.max_message_bytes}); use a smaller block_size or raise --max-message-bytes"
        )


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite. A finite float32 sum proves it (any NaN or ±Inf makes the sum NaN or
    infinite) at a fraction of isfinite().all()'s cost (100 us against 4.4 ms for 8 MiB here); only a sum that is
    not finite, from a bad element or from overflow of huge finite values, takes the exact elementwise check."""
    return bool(torch.isfinite(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


def pages_per_block(spec: TranslateSpec, limits: Limits, bytes_per_token: int) -> int:
    """Paged: the most pages one block carries, the request's pages_per_block capped to what fits one message
    (check_spec has made sure one page does); 0 for one page a block in the three-dimensional form, and for
    the contiguous layout."""
    if spec.layout != PAGED or not spec.pages_per_block:
        return 0
    return min(spec.pages_per_block, limits.tokens_per_message(bytes_per_token) // spec.block_size)


def target_dtype(spec: TranslateSpec, ms: MapSet) -> torch.dtype:
    """The dtype of the returned (and stored) target KV: the request's, else the source dtype, or the map's when it
    is narrower (a bfloat16 map's output carries bfloat16 precision; wider bytes would carry no more information)."""
    if spec.target_dtype is not None:
        return spec.target_dtype
    narrower = torch.empty((), dtype=ms.dtype).element_size() < torch.empty((), dtype=spec.source_dtype).element_size()
    return ms.dtype if narrower else spec.source_dtype


class TranslateSession:
    """One request's state: per (layer, kind) the next expected token, the applier, partial pages.

        Chunks go to the applier as they arrive; whatever target KV they complete leaves at once, as
        token-range blocks (contiguous layout: several blocks per layer, in token order) or as pages.
        ``cached``: target KV for the first tokens, found in the prefix store: a Lookup (its blocks' bytes are
        sent as stored when the layout is contiguous and the dtype matches: one copy, into the messages), or
        per target layer (K, V) [1, kv_heads, m, head_dim]; those tokens are not mapped again.
        ``expect_chunks=False`` for requests whose
        source KV came from the store. ``keep_output`` retains the target KV (for write-back). ``lanes``: the tokens
        are mapped in
    lanes on those threads (compute.py); then blocks may leave only at ``drain``.
    """

    def __init__(
        self,
        spec: TranslateSpec,
        ms: MapSet,
        limits: Limits,
        cached: Lookup | list | None = None,
        expect_chunks: bool = True,
        keep_output: bool = False,
        lanes: Lanes | None = None,
    ):
        check_spec(spec, ms, limits)
        self.spec, self.ms = spec, ms
        self.out_dtype = target_dtype(spec, ms)
        self.stored: Lookup | None = None  # a cached prefix sent from its stored bytes
        if isinstance(cached, Lookup):
            if cached.blocks and cached.as_stored and spec.layout != PAGED and not keep_output:
                self.stored, cached = cached, None
            else:  # paged: joined token-major, so that its pages are views of the join
                cached = cached.layers(token_major=spec.layout == PAGED)
        self.cached = cached or None
        self.skip = self.stored.tokens if self.stored else int(cached[0][0].shape[2]) if cached else 0
        self.expect_chunks = expect_chunks
        self.outputs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = {} if keep_output else None
        n = spec.num_tokens
        # a windowed map also reads the source tokens just before the first it maps: those of the cached prefix
        self.context = min(ms.context, spec.start_position + self.skip)
        if self.context > self.skip:
            raise InvalidInput(
                f"map {ms.name} {ms.version} reads the {ms.context} source tokens before each token, and this "
                f"request starts at position {spec.start_position} without them: send the sequence from "
                "position 0 (its cached prefix is not mapped again), or use a per-token map"
            )
        args = (ms, spec.start_position + self.skip, self.out_dtype, n - self.skip, self.context)
        self.applier = (
            None if self.skip >= n else lanes.applier(*args) if lanes is not None else StreamingApplier(*args)
        )
        layers = ms.target.geometry.layers
        self._next: dict[tuple[int, str], int] = {}
        self._checked: tuple[int, str, int, int] | None = None  # the chunk whose header was checked before its bytes
        self._index = [0] * layers  # next contiguous block index per target layer
        self._page: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(layers)]  # pending paged tokens
        self._page_fill = [0] * layers
        self._page_start = [0] * layers
        self.stats = Stats(tokens=n)
        self._t0 = time.perf_counter()
        per_token = 2 * ms.target.geometry.kv_width * torch.empty((), dtype=self.out_dtype).element_size()
        self._block_tokens = limits.tokens_per_message(per_token)  # a contiguous block never outgrows a message
        self._pages = pages_per_block(spec, limits, per_token)

    def info(self) -> TargetInfo:
        g = self.ms.target.geometry
        return TargetInfo(
            self.ms.name,
            self.ms.version,
            g.architecture,
            g.layers,
            g.kv_heads,
            g.head_dim,
            g.fingerprint,
            self.spec.layout,
            self.spec.block_size,
            self.out_dtype,
            self.spec.num_tokens,
            self.spec.start_position,
            self._pages,
        )

    def expected_shape(self, layer_tokens: int) -> tuple[int, int, int]:
        g = self.ms.source.geometry
        return (g.kv_heads, layer_tokens, g.head_dim)

    def initial_blocks(self) -> list[Block | BlockBytes]:
        """Blocks that need no source data: the cached prefix, if any."""
        out = self._emit_stored() if self.stored else []
        for t, (k, v) in enumerate(self.cached or []):
            out += self._emit(t, [(0, self.skip, k.to(self.out_dtype), v.to(self.out_dtype))])
        return out

    def check_chunk_header(self, layer: int, kind: str, start: int, end: int) -> None:
        """Order and range checks, before the chunk's bytes are decoded; ``add`` of that very chunk does not
        repeat them."""
        g = self.ms.source.geometry
        if not self.expect_chunks:
            raise InvalidInput(
                "this request names a prefix_key: its source KV comes from the prefix store; send no chunks"
            )
        if not 0 <= layer < g.layers:
            raise InvalidInput(f"chunk layer {layer} out of range: the source model has {g.layers} layers")
        nxt = self._next.get((layer, kind), 0)
        if nxt >= self.spec.num_tokens:
            raise InvalidInput(f"layer {layer} {kind.upper()} already received all {self.spec.num_tokens} tokens")
        if start != nxt:
            raise InvalidInput(
                f"chunks out of order: layer {layer} {kind.upper()} expected token_start {nxt}, got {start}"
            )
        if not start < end <= self.spec.num_tokens:
            raise InvalidInput(
                f"chunk layer {layer} {kind.upper()} token range [{start}, {end}) is empty or past "
                f"num_tokens={self.spec.num_tokens}"
            )
        self._checked = (layer, kind, start, end)

    def add(self, chunk: Chunk) -> list[Block]:
        """Take one decoded chunk; return the target blocks it completed (possibly none)."""
        if self._checked != (chunk.layer, chunk.kind, chunk.start, chunk.end):
            self.check_chunk_header(chunk.layer, chunk.kind, chunk.start, chunk.end)
        self._checked = None
        want = self.expected_shape(chunk.end - chunk.start)
        if tuple(chunk.tensor.shape) != want:
            raise InvalidInput(
                f"chunk layer {chunk.layer} {chunk.kind.upper()}: shape {list(chunk.tensor.shape)}, expected "
                f"{list(want)}"
            )
        if chunk.tensor.dtype != self.spec.source_dtype:
            raise InvalidInput(
                f"chunk layer {chunk.layer} {chunk.kind.upper()}: dtype {chunk.tensor.dtype} but the header "
                f"declared {self.spec.source_dtype}"
            )
        if not all_finite(chunk.tensor):  # NaN/Inf would map to NaN/Inf
            raise InvalidInput(
                f"chunk layer {chunk.layer} {chunk.kind.upper()} tokens [{chunk.start}, {chunk.end}) holds NaN "
                "or infinite values; send the source model's cache as it computed it"
            )
        self.stats.bytes_in += chunk.tensor.numel() * chunk.tensor.element_size()
        self._next[(chunk.layer, chunk.kind)] = chunk.end
        first = self.skip - self.context  # the first token the applier reads
        if self.applier is None or chunk.end <= first:
            return []  # covered by the prefix store: validated, not mapped
        lo = max(chunk.start, first)
        tensor = chunk.tensor[:, lo - chunk.start :][None]
        t0 = time.perf_counter()
        blocks = self._emit_all(self.applier.push(chunk.layer, chunk.kind, tensor, lo - self.skip))
        self.stats.compute_seconds += time.perf_counter() - t0
        return blocks

    def drain(self) -> list[Block]:
        """After the last chunk: the blocks whose map was still running (lanes), once it has finished. Refuses a
        truncated stream first (nothing to wait for)."""
        self._check_complete()
        if self.applier is None:
            return []
        blocks = self._emit_all(self.applier.drain())
        self.stats.compute_seconds += self.applier.lane_seconds
        return blocks

    def poll(self) -> list[Block]:
        """The blocks whose map finished after ``add`` returned (lanes: see ``wake_on_output``)."""
        return self._emit_all(self.applier.poll()) if self.applier is not None else []

    def wake_on_output(self, wake) -> bool:
        """Have ``wake()`` called (from another thread) whenever the map finishes output after ``add`` returned;
        False when it never does (its output always comes back from ``add``)."""
        if self.applier is None or not self.applier.maps_off_thread:
            return False
        self.applier.on_output = wake
        return True

    def close(self) -> None:
        """The request ended (answered or not): work still queued for it is dropped."""
        if self.applier is not None:
            self.applier.close()

    def _emit_all(self, mapped) -> list[Block | BlockParts]:
        """Blocks of the mapped pieces (target layer, start, end, K, V). Consecutive pieces of one layer (lanes hand a
        layer over in several pieces at once) leave together: in one contiguous block where they fit one message,
        joined only as it is written (each message costs both ends a fixed amount), or cut into pages across them."""
        blocks = []
        for run in runs(mapped):
            blocks += self._emit(run[0][0], [(a + self.skip, b + self.skip, k, v) for _, a, b, k, v in run])
        return blocks

    def _emit(self, layer: int, pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> list[Block | BlockParts]:
        """Blocks of one layer's consecutive pieces (a, b, K, V), K and V [1, kv_heads, b - a, head_dim] for target
        tokens [a, b)."""
        if self.outputs is not None:
            self.outputs.setdefault(layer, []).extend((k, v) for _, _, k, v in pieces)
        if self.spec.layout == PAGED:
            for a, b, k, v in pieces:
                self._page[layer].append((k[0].transpose(0, 1), v[0].transpose(0, 1)))  # [tokens, H, D]
                self._page_fill[layer] += b - a
            return self._cut(layer)
        out = []
        for s in range(pieces[0][0], pieces[-1][1], self._block_tokens):  # cut to the message limit
            e = min(s + self._block_tokens, pieces[-1][1])
            parts = [
                (k[0][:, max(s - a, 0) : e - a], v[0][:, max(s - a, 0) : e - a])
                for a, b, k, v in pieces
                if a < e and b > s
            ]
            if len(parts) == 1:
                out.append(Block(layer, s, e, self._index[layer], *parts[0]))
            else:
                out.append(BlockParts(layer, s, e, self._index[layer], [k for k, _ in parts], [v for _, v in parts]))
            self._index[layer] += 1
        self._count(out)
        return out

    def _cut(self, layer: int) -> list[Block]:
        """The layer's pending tokens as blocks of whole pages; its last, partial page once every token is in."""
        out = []
        bs, most = self.spec.block_size, max(self._pages, 1)
        last = self._page_start[layer] + self._page_fill[layer] == self.spec.num_tokens
        while self._page_fill[layer] >= bs or (last and self._page_fill[layer]):  # up to `most` pages a block
            out.append(
                self._cut_pages(
                    layer,
                    min(self._page_fill[layer], most * bs) if last else min(self._page_fill[layer] // bs, most) * bs,
                )
            )
        self._count(out)
        return out

    def _emit_stored(self) -> list[BlockBytes]:
        """The stored prefix, layer by layer, cut to the message limit: pieces of the stored blobs, no tensors."""
        g, out = self.ms.target.geometry, []
        for t in range(g.layers):
            for s in range(0, self.skip, self._block_tokens):
                e = min(s + self._block_tokens, self.skip)
                out.append(
                    BlockBytes(
                        t,
                        s,
                        e,
                        self._index[t],
                        self.out_dtype,
                        (g.kv_heads, e - s, g.head_dim),
                        self.stored.pieces(t, 0, s, e),
                        self.stored.pieces(t, 1, s, e),
                    )
                )
                self._index[t] += 1
        self._count(out)
        return out

    def _cut_pages(self, layer: int, take: int) -> Block:
        """The layer's next ``take`` pending tokens as one block of whole pages, the last zero-padded:
        [pages, block_size, H, D], or [block_size, H, D] when the request asked for one page a block."""
        bs = self.spec.block_size
        ks, vs, got = [], [], 0
        pending = self._page[layer]
        while got < take:
            k, v = pending[0]
            need = take - got
            if k.shape[0] <= need:
                ks.append(k), vs.append(v)
                got += k.shape[0]
                pending.pop(0)
            else:
                ks.append(k[:need]), vs.append(v[:need])
                pending[0] = (k[need:], v[need:])
                got = take
        kb, vb = (ks[0], vs[0]) if len(ks) == 1 else (torch.cat(ks), torch.cat(vs))  # one piece: a view, no copy
        pages = -(-take // bs)
        if take < pages * bs:  # the layer's last, partial page: zero-padded
            pad = (0, 0, 0, 0, 0, pages * bs - take)
            kb, vb = torch.nn.functional.pad(kb, pad), torch.nn.functional.pad(vb, pad)
        shape = (pages, bs, *kb.shape[1:]) if self._pages else kb.shape
        start = self._page_start[layer]
        self._page_fill[layer] -= take
        self._page_start[layer] += take
        return Block(layer, start, start + take, start // bs, kb.reshape(shape), vb.reshape(shape))

    def _count(self, blocks: list[Block | BlockBytes | BlockParts]) -> None:
        self.stats.bytes_out += sum(b.nbytes for b in blocks)
        self.stats.blocks += len(blocks)

    def output_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The kept target KV joined per layer: (K, V) [1, kv_heads, tokens, head_dim]."""
        return [
            (torch.cat([k for k, _ in self.outputs[t]], 2), torch.cat([v for _, v in self.outputs[t]], 2))
            for t in sorted(self.outputs or {})
        ]

    def finish(self) -> Stats:
        """Call when the request stream ends (after ``drain``); raises if any layer is incomplete."""
        self._check_complete()
        self.stats.wall_seconds = time.perf_counter() - self._t0
        return self.stats

    def _check_complete(self) -> None:
        g = self.ms.source.geometry
        missing = [
            f"{l}{k.upper()}" for l in range(g.layers) for k in "kv" if self._next.get((l, k), 0) < self.spec.num_tokens
        ]
        if self.expect_chunks and missing:
            raise InvalidInput(
                f"truncated stream: source layers {', '.join(missing[:8])}{'…' if len(missing) > 8 else ''} "
                f"did not receive all {self.spec.num_tokens} tokens"
            )


def runs(mapped) -> Iterator[list]:
    """The mapped pieces (layer, start, end, K, V) in lists of consecutive pieces of one layer, in the order given."""
    run = []
    for piece in mapped:
        if run and (piece[0] != run[-1][0] or piece[1] != run[-1][2]):
            yield run
            run = []
        run.append(piece)
    if run:
        yield run


def start_session(*args, **kw) -> tuple[TranslateSession, list[Block | BlockBytes]]:
    """A TranslateSession (its arguments) and its initial blocks: the cached prefix, cast, joined or paged, which is
    tensor work, so callers run this on the sidecar's compute thread (compute.py)."""
    session = TranslateSession(*args, **kw)
    return session, session.initial_blocks()
