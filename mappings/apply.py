"""Apply a MapSet to a source cache: batched, any device, dtype-preserving, and streaming.

Keys: un-rotate with the source RoPE, map in position-free space, rotate with the target RoPE
at the same absolute positions. Values: map directly. The matmul runs in the maps' dtype (float32
or bfloat16) where the device is fast at it, else in float32 (``precision.matmul_dtype``); a bfloat16 map's output
is rounded to bfloat16 before any cast to the output dtype either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from .artifact import KINDS, MapSet
from .cache import LayerKV
from .errors import InvalidInput
from .features import from_features, to_features
from .precision import matmul_dtype


class TokenLanes(Protocol):
    """What ``apply`` needs of a caller's threads that map token ranges at once (the sidecar's lanes): an applier
    with StreamingApplier's ``push`` and ``drain``."""

    def applier(self, ms: MapSet, position: int, out_dtype, tokens: int, context: int): ...


def _append_merged(pieces: list[tuple[int, torch.Tensor]], start: int, t: torch.Tensor, dim: int) -> None:
    """Append a contiguous token range, merging the newest pieces while the older is no larger (a binary counter):
    every token is copied O(log n) times and a list holds O(log n) pieces, so n one-token chunks cost
    O(n log n), not O(n²) (found with chunks of one token sent layer by layer)."""
    pieces.append((start, t))
    while len(pieces) > 1 and pieces[-2][1].shape[dim] <= pieces[-1][1].shape[dim]:
        (s0, a), (_, b) = pieces[-2], pieces[-1]
        pieces[-2:] = [(s0, torch.cat([a, b], dim=dim))]


def check_push(
    ms: MapSet, layer: int, kind: str, tensor: torch.Tensor, start: int, expect: int, tokens: int | None
) -> None:
    """Refuse a source chunk that is not the next one of its (layer, kind): ``expect`` is the next token it must start
    at, ``tokens`` the declared total (None: open-ended)."""
    sg = ms.source.geometry
    if kind not in KINDS:
        raise InvalidInput(f"kind must be 'k' or 'v', got {kind!r}")
    if not 0 <= layer < sg.layers:
        raise InvalidInput(f"source layer {layer} out of range 0..{sg.layers - 1}")
    if tensor.dim() != 4 or tensor.shape[1] != sg.kv_heads or tensor.shape[3] != sg.head_dim:
        raise InvalidInput(
            f"source layer {layer} {kind.upper()} has shape {tuple(tensor.shape)}; expected "
            f"[batch, {sg.kv_heads}, tokens, {sg.head_dim}]"
        )
    if start != expect:
        raise InvalidInput(
            f"source layer {layer} {kind.upper()}: tokens must arrive in order; expected start "
            f"{expect}, got {start}" + (" (sent twice?)" if start < expect else "")
        )
    if tokens is not None and start + tensor.shape[2] > tokens:
        raise InvalidInput(f"source layer {layer} {kind.upper()}: tokens past the declared {tokens}")


class CodeSums:
    """A shared-basis set's codes, summed as source chunks arrive: each (layer, kind) chunk adds its features times its
    rows of the encoder to its tokens' codes. Chunks of one token range are multiplied together, ``batch`` at a
    time (one matmul over their features side by side, one addition into the float32 sums: adding each chunk on its
    own costs a pass over the sums per chunk, measured at a fifth of the apply at 2,048 tokens); the rest wait at most
    until the codes are taken. Tokens before ``first`` are taken (decoded) and dropped; the buffer grows as later
    tokens arrive."""

    def __init__(self, basis, width: int, compute: torch.dtype, device, batch: int = 8):
        self.basis, self.width, self.batch = basis, width, batch
        self.encoder = basis.encoder.to(device=device, dtype=compute)
        self.bias = basis.bias.to(device=device, dtype=torch.float32)
        self.first = 0  # token index of self.sums[:, 0]
        self.sums: torch.Tensor | None = None  # [B, tokens held, rank]
        self._pending: list[tuple[int, str, int, torch.Tensor]] = []  # chunks of one token range, not yet added

    def add(self, layer: int, kind: str, start: int, feats: torch.Tensor) -> None:
        """Add one source chunk's contribution: ``feats`` [B, n, width] for tokens [start, start + n)."""
        if self._pending and (self._pending[0][2], self._pending[0][3].shape[1]) != (start, feats.shape[1]):
            self.flush()
        self._pending.append((layer, kind, start, feats))
        if len(self._pending) >= self.batch:
            self.flush()

    def flush(self) -> None:
        """Add the pending chunks (one token range) into the sums."""
        if not self._pending:
            return
        _, _, start, first = self._pending[0]
        b, n = first.shape[0], first.shape[1]
        x = torch.cat([f for _, _, _, f in self._pending], dim=-1).reshape(b * n, -1).to(self.encoder.dtype)
        rows = torch.cat(
            [self.encoder[self.basis.rows(layer, kind, self.width)] for layer, kind, _, _ in self._pending]
        )
        self._pending = []
        end = start + n - self.first
        if self.sums is None:
            self.sums = self.bias.expand(b, end, -1).clone()
        elif end > self.sums.shape[1]:
            grow = max(end - self.sums.shape[1], self.sums.shape[1])  # doubling: O(n) copies for n small chunks
            self.sums = torch.cat([self.sums, self.bias.expand(self.sums.shape[0], grow, -1)], dim=1)
        self.sums[:, start - self.first : end].add_((x @ rows).reshape(b, n, -1))

    def take(self, a: int, b: int) -> torch.Tensor:
        """The finished codes of tokens [a, b) (every source chunk of them added; ``a`` is the first token held), which
        are then dropped."""
        self.flush()
        out = self.sums[:, a - self.first : b - self.first]
        self.sums, self.first = self.sums[:, b - self.first :], b
        return out


class StreamingApplier:
    """Feed source chunks (a layer's K or V for a token range) in any order; get target KV out as
    soon as it can be computed.

    Maps are per-token, so target tokens [a, b) of a target layer need only tokens [a, b) of its
    source layers: whatever order chunks arrive in (layer by layer, or token range by token range),
    each piece of output leaves as early as possible, and source features are dropped once every
    map that reads them has consumed them. ``push`` yields (target_layer, start, end, K, V) with
    K, V [B, kv_heads, end - start, head_dim]; token indices are relative to the first token.

    A shared-basis set (``ms.basis``) keeps no features: each chunk is folded into its tokens' codes as it arrives
    (:class:`CodeSums`), and every target layer of a token range is decoded at once when its last source chunk has come.
    What that gives up: no target layer of a range leaves before every source layer of it has arrived (a per-layer set
    emits a target layer once its own few source layers are in).

    Windowed maps (``ms.context`` > 0) also read the tokens before each token. Before position 0 there are none (the
    fit saw zeros there too); a translation that starts later must first push those ``context`` tokens, at negative
    indices -context..-1: they are read, never mapped. Without them the applier refuses to start, since the first
    tokens would be mapped from a context they do not have.
    """

    def __init__(
        self,
        ms: MapSet,
        positions: int = 0,
        out_dtype: torch.dtype | None = None,
        tokens: int | None = None,
        context: int = 0,
    ):
        if not isinstance(positions, int):
            raise InvalidInput("positions must be the absolute position (int) of the first token")
        if context != min(ms.context, positions):
            raise InvalidInput(
                f"map {ms.name} {ms.version} reads the {ms.context} source tokens before each token; a "
                f"translation starting at position {positions} must also send the "
                f"{min(ms.context, positions)} before it (got {context}). Translate from position 0 or "
                "send that context"
            )
        self.ms = ms
        self.start_position = positions
        self.context = context
        self.out_dtype = out_dtype
        self.tokens = tokens  # total tokens, when known: completion is then checkable
        self._groups = ms.fused_groups(
            matmul_dtype(ms.dtype, ms.device)
        )  # maps reading the same source features share one matmul
        self._codes: CodeSums | None = None  # a shared-basis set's code sums, made at the first push (its device)
        self._done = [0] * len(self._groups)  # tokens mapped per group
        self._next: dict[tuple[int, str], int] = {}  # tokens received per source (layer, kind); starts at -context
        self._feats: dict[tuple[int, str], list[tuple[int, torch.Tensor]]] = {}  # (start, [B, n, w]) pieces
        self._reads = [[(s, c) for s in sources for c in inputs] for (sources, inputs, _), _, _, _ in self._groups]
        self._readers: dict[tuple[int, str], list[int]] = {}  # per source (layer, kind): the groups reading it
        for gi, reads in enumerate(self._reads):
            for key in reads:
                self._readers.setdefault(key, []).append(gi)
        tl = ms.target.geometry.layers
        self._out: dict[tuple[int, str], list[tuple[int, torch.Tensor]]] = {
            (t, k): [] for t in range(tl) for k in KINDS
        }
        self._produced = {(t, k): 0 for t in range(tl) for k in KINDS}
        self._emitted = [0] * tl

    def push(
        self, layer: int, kind: str, tensor: torch.Tensor, start: int = 0
    ) -> Iterator[tuple[int, int, int, torch.Tensor, torch.Tensor]]:
        """Add source ``layer``'s K ("k") or V ("v") for tokens [start, start + T): tensor [B, H, T, D]."""
        sg = self.ms.source.geometry
        key = (layer, kind)
        check_push(self.ms, layer, kind, tensor, start, self._next.get(key, -self.context), self.tokens)
        n = tensor.shape[2]
        if self.out_dtype is None:
            self.out_dtype = tensor.dtype
        self._next[key] = start + n
        if key not in self._readers:  # no map reads it
            return
        pos = range(self.start_position + start, self.start_position + start + n)
        rope = sg.rope if kind == "k" else None
        feats = torch.empty(tensor.shape[0], n, sg.kv_width, dtype=self.ms.dtype, device=tensor.device)
        to_features(tensor, rope, pos, self.ms.dtype, feats)
        if self.ms.basis is not None:
            if self._codes is None:
                self._codes = CodeSums(
                    self.ms.basis, sg.kv_width, matmul_dtype(self.ms.dtype, tensor.device), tensor.device
                )
            self._codes.add(layer, kind, start, feats)
        else:
            _append_merged(self._feats.setdefault(key, []), start, feats, dim=1)
        yield from self._advance(self._readers[key])

    def _slice(self, key: tuple[int, str], a: int, b: int) -> torch.Tensor:
        """Features of tokens [a, b); tokens before the first pushed one (before position 0) read zeros."""
        first = -self.context
        parts = [(s, f) for s, f in self._feats[key] if s < b and s + f.shape[1] > a]
        pieces = [f[:, max(a - s, 0) : min(b - s, f.shape[1])] for s, f in parts]
        if a < first:
            f = self._feats[key][0][1]
            pieces.insert(0, f.new_zeros(f.shape[0], min(first, b) - a, f.shape[2]))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def _inputs(self, group: tuple, a: int, b: int) -> torch.Tensor:
        """A group's map input for tokens [a, b): its source features side by side, then (windowed) those of the
        window - 1 tokens before, nearest first."""
        sources, inputs, window = group
        return torch.cat(
            [self._slice((s, c), a - o, b - o) for o in range(window) for s in sources for c in inputs], dim=-1
        )

    def _advance(self, groups: list[int]):
        """Map what ``groups`` (those reading the source just pushed: no other can have become ready) can now map, drop
        the features no map needs any more, and yield the target layers they completed."""
        tg = self.ms.target.geometry
        advanced, layers = [], set()
        for gi in groups:
            ready = min(self._next.get(key, -self.context) for key in self._reads[gi])
            a = self._done[gi]
            if ready <= a:
                continue
            _, keys, _, _ = self._groups[gi]
            if self._codes is not None:
                self._codes.flush()  # the range is complete: its last chunks join the sums
            f = self._codes.sums if self._codes is not None else self._feats[self._reads[gi][0]][0][1]
            outs = [
                torch.empty(f.shape[0], tg.kv_heads, ready - a, tg.head_dim, dtype=self.out_dtype, device=f.device)
                for _ in keys
            ]
            self._map_rows(gi, a, ready, outs)
            for (t, kind), out in zip(keys, outs):
                _append_merged(self._out[(t, kind)], a, out, dim=2)
                self._produced[(t, kind)] = ready
                layers.add(t)
            self._done[gi] = ready
            advanced.append(gi)
        self._trim({key for gi in advanced for key in self._reads[gi]})
        for t in sorted(layers):
            upto = min(self._produced[(t, "k")], self._produced[(t, "v")])
            a = self._emitted[t]
            if upto > a:
                k = self._take((t, "k"), a, upto)
                v = self._take((t, "v"), a, upto)
                self._emitted[t] = upto
                yield t, a, upto, k, v

    def _map_rows(self, gi: int, a: int, b: int, outs: list[torch.Tensor]) -> None:
        """Group ``gi``'s map for tokens [a, b), written into ``outs`` (one [B, H, b - a, D] tensor per target (layer,
        kind) the group feeds)."""
        tg = self.ms.target.geometry
        group, keys, _, _ = self._groups[gi]
        x = self._codes.take(a, b) if self._codes is not None else self._inputs(group, a, b)
        compute = matmul_dtype(self.ms.dtype, x.device)
        if self._codes is not None and self.ms.basis.mlp is not None:
            x = self.ms.basis.mlp(x, compute)  # the code refined before every map reads it
        _, _, w, bias = self.ms.fused_groups(compute)[gi]
        rows = x.reshape(-1, x.shape[-1]).to(compute)  # features already carry the stored dtype's rounding
        y = torch.addmm(bias.to(x.device), rows, w.to(x.device)).reshape(x.shape[0], x.shape[1], -1)
        pos = range(self.start_position + a, self.start_position + b)
        width = tg.kv_width
        for i, ((_, kind), out) in enumerate(zip(keys, outs)):
            kv = from_features(y[..., i * width : (i + 1) * width], tg.kv_heads, tg.rope if kind == "k" else None, pos)
            # a bf16 map's output carries bf16 precision: round to it, so the evidence holds for bf16 on the wire too
            out.copy_(kv if self.out_dtype == self.ms.dtype else kv.to(self.ms.dtype))

    def _take(self, key, a: int, b: int) -> torch.Tensor:
        parts = self._out[key]
        pieces = [o[:, :, max(a - s, 0) : min(b - s, o.shape[2])] for s, o in parts if s < b and s + o.shape[2] > a]
        self._out[key] = [(s, o) for s, o in parts if s + o.shape[2] > b]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)

    def _trim(self, keys) -> None:
        """Drop the features of ``keys`` (source (layer, kind)s) that every map reading them is past."""
        for key in keys:
            if key not in self._feats:
                continue
            low = min(
                self._done[g] - self._groups[g][0][2] + 1 for g in self._readers[key]
            )  # windows keep their last tokens
            self._feats[key] = [(s, f) for s, f in self._feats[key] if s + f.shape[1] > low]

    maps_off_thread = False  # push yields everything its chunk completes; nothing is finished later

    def poll(self) -> Iterator[tuple[int, int, int, torch.Tensor, torch.Tensor]]:
        """Output finished since the last push: none here (``push`` yields it all)."""
        return iter(())

    def drain(self) -> Iterator[tuple[int, int, int, torch.Tensor, torch.Tensor]]:
        """What pushed chunks completed and ``push`` has not yet yielded: nothing here (``push`` yields it all; a
        LanedApplier may hold some back)."""
        return iter(())

    def close(self) -> None:
        """Drop work not yet done (nothing to drop here: ``push`` does its work before it returns)."""

    @property
    def lane_seconds(self) -> float:
        """Map time spent off the calling thread: none here."""
        return 0.0

    @property
    def emitted(self) -> int:
        """Tokens emitted for every target layer."""
        return min(self._emitted)

    @property
    def done(self) -> bool:
        return self.tokens is not None and self.emitted >= self.tokens


@torch.no_grad()
def apply(
    ms: MapSet, source_kv: list[LayerKV], positions: int = 0, context: int = 0, lanes: TokenLanes | None = None
) -> list[LayerKV]:
    """Map a whole source cache whose first mapped token sits at absolute position ``positions``. ``context``: for a
    windowed map starting past position 0, the cache's first tokens are the ``context`` before it (read, not mapped).
    ``lanes``: map token ranges on those threads at once (the sidecar's kvferry.sidecar.lanes)."""
    if len(source_kv) != ms.source.geometry.layers:
        raise InvalidInput(f"source cache has {len(source_kv)} layers; the map expects {ms.source.geometry.layers}")
    n = int(source_kv[0][0].shape[2]) - context
    applier = (
        lanes.applier(ms, positions or 0, None, n, context)
        if lanes is not None
        else StreamingApplier(ms, positions or 0, context=context)
    )
    out: dict[int, list[LayerKV]] = {}
    for layer, (k, v) in enumerate(source_kv):
        for kind, tensor in (("k", k), ("v", v)):
            for t, _a, _b, tk, tv in applier.push(layer, kind, tensor, -context):
                out.setdefault(t, []).append((tk, tv))
    for t, _a, _b, tk, tv in applier.drain():
        out.setdefault(t, []).append((tk, tv))
    return [_joined(out[t]) for t in range(ms.target.geometry.layers)]


def _joined(pieces: list[LayerKV]) -> LayerKV:
    """A target layer's pieces in token order, as one (K, V): the piece itself when there is one."""
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat([k for k, _ in pieces], 2), torch.cat([v for _, v in pieces], 2)
