"""Apply a MapSet to a source cache: batched, any device, dtype-preserving, and streaming.

Keys: un-rotate with the source RoPE, map in position-free space, rotate with the target RoPE
at the same absolute positions. Values: map directly.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .artifact import KINDS, MapSet
from .capture import LayerKV
from .errors import InvalidInput
from .features import from_features, to_features


def _positions(positions, tokens: int, device) -> torch.Tensor:
    if positions is None:
        return torch.arange(tokens, device=device)
    if isinstance(positions, int):
        return torch.arange(positions, positions + tokens, device=device)
    return positions.to(device)


class StreamingApplier:
    """Feed source layers in any order; get each target layer as soon as its sources are present.

    Source features are dropped once no pending target layer needs them, so memory stays
    bounded by the maps' source windows rather than the whole cache.
    """

    def __init__(self, ms: MapSet, positions=None, out_dtype: torch.dtype | None = None):
        self.ms = ms
        self.positions = positions
        self.out_dtype = out_dtype
        self._feats: dict[tuple[int, str], torch.Tensor] = {}
        self._partial: dict[int, dict[str, torch.Tensor]] = {}
        self._pending = {(t, kind) for (t, kind) in ms.maps}
        self._uses: dict[tuple[int, str], int] = {}
        for (t, kind), m in ms.maps.items():
            for s in m.source_layers:
                for c in m.inputs:
                    self._uses[(s, c)] = self._uses.get((s, c), 0) + 1
        self._emitted: set[int] = set()

    def needed_by(self, source_layer: int) -> list[int]:
        return sorted({t for (t, k), m in self.ms.maps.items() if source_layer in m.source_layers})

    def push(self, layer: int, kind: str, tensor: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Add source ``layer``'s K (kind "k") or V ("v") [B, H, T, D]; yield completed (t, K, V)."""
        sg = self.ms.source.geometry
        if kind not in KINDS:
            raise InvalidInput(f"kind must be 'k' or 'v', got {kind!r}")
        if not 0 <= layer < sg.layers:
            raise InvalidInput(f"source layer {layer} out of range 0..{sg.layers - 1}")
        if (layer, kind) in self._feats:
            raise InvalidInput(f"source layer {layer} {kind.upper()} sent twice")
        if tensor.dim() != 4 or tensor.shape[1] != sg.kv_heads or tensor.shape[3] != sg.head_dim:
            raise InvalidInput(f"source layer {layer} {kind.upper()} has shape {tuple(tensor.shape)}; expected "
                               f"[batch, {sg.kv_heads}, tokens, {sg.head_dim}]")
        if self.out_dtype is None:
            self.out_dtype = tensor.dtype
        pos = _positions(self.positions, tensor.shape[2], tensor.device)
        self._feats[(layer, kind)] = to_features(tensor, sg.rope if kind == "k" else None, pos)
        yield from self._ready(pos)

    def _ready(self, pos: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        tg = self.ms.target.geometry
        for t, kind in sorted(self._pending):
            m = self.ms.maps[(t, kind)]
            if not all((s, c) in self._feats for s in m.source_layers for c in m.inputs):
                continue
            x = torch.cat([self._feats[(s, c)] for s in m.source_layers for c in m.inputs], dim=-1)
            w = m.weight.to(device=x.device)
            y = torch.addmm(m.bias.to(x.device), x.reshape(-1, x.shape[-1]), w).reshape(x.shape[0], x.shape[1], -1)
            out = from_features(y, tg.kv_heads, tg.rope if kind == "k" else None, pos).to(self.out_dtype)
            self._pending.discard((t, kind))
            for s in m.source_layers:
                for c in m.inputs:
                    self._uses[(s, c)] -= 1
                    if self._uses[(s, c)] == 0:
                        self._feats[(s, c)] = self._feats[(s, c)][:, :0]  # free, but remember it arrived
            part = self._partial.setdefault(t, {})
            part[kind] = out
            if len(part) == 2:
                del self._partial[t]
                yield t, part["k"], part["v"]

    @property
    def done(self) -> bool:
        return not self._pending and not self._partial


@torch.no_grad()
def apply(ms: MapSet, source_kv: list[LayerKV], positions=None) -> list[LayerKV]:
    """Map a whole source cache; ``positions`` is a start offset (int) or a [T] tensor."""
    if len(source_kv) != ms.source.geometry.layers:
        raise InvalidInput(f"source cache has {len(source_kv)} layers; the map expects {ms.source.geometry.layers}")
    applier = StreamingApplier(ms, positions)
    out: dict[int, LayerKV] = {}
    for layer, (k, v) in enumerate(source_kv):
        for kind, tensor in (("k", k), ("v", v)):
            for t, tk, tv in applier.push(layer, kind, tensor):
                out[t] = (tk, tv)
    return [out[t] for t in range(ms.target.geometry.layers)]
