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


def fused_groups(ms: MapSet) -> list[tuple[tuple, list[tuple[int, str]], torch.Tensor, torch.Tensor]]:
    """Maps that read the same source features, with their weights side by side (cached on the MapSet).

    With k = all source layers every map reads the same input, so one matmul serves all of them.
    """
    cache = getattr(ms, "_fused", None)
    if cache is not None:
        return cache
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for key, m in sorted(ms.maps.items()):
        groups.setdefault((m.source_layers, m.inputs), []).append(key)
    out = []
    for (sources, inputs), keys in groups.items():
        w = torch.cat([ms.maps[k].weight for k in keys], dim=1)
        b = torch.cat([ms.maps[k].bias for k in keys])
        out.append(((sources, inputs), keys, w, b))
    ms._fused = out
    return out


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
        self._groups = list(fused_groups(ms))
        self._uses: dict[tuple[int, str], int] = {}
        for (sources, inputs), _, _, _ in self._groups:
            for s in sources:
                for c in inputs:
                    self._uses[(s, c)] = self._uses.get((s, c), 0) + 1
        self._pos: torch.Tensor | None = None

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
        if self._pos is not None and tensor.shape[2] != self._pos.shape[-1]:
            raise InvalidInput(f"source layer {layer} {kind.upper()} has {tensor.shape[2]} tokens, others {self._pos.shape[-1]}")
        if self.out_dtype is None:
            self.out_dtype = tensor.dtype
        if self._pos is None:
            self._pos = _positions(self.positions, tensor.shape[2], tensor.device)
        self._feats[(layer, kind)] = to_features(tensor, sg.rope if kind == "k" else None, self._pos)
        yield from self._ready()

    def _ready(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        tg = self.ms.target.geometry
        width = tg.kv_width
        remaining = []
        for group in self._groups:
            (sources, inputs), keys, w, b = group
            if not all((s, c) in self._feats for s in sources for c in inputs):
                remaining.append(group)
                continue
            x = torch.cat([self._feats[(s, c)] for s in sources for c in inputs], dim=-1)
            y = torch.addmm(b.to(x.device), x.reshape(-1, x.shape[-1]), w.to(x.device)).reshape(x.shape[0], x.shape[1], -1)
            for s in sources:
                for c in inputs:
                    self._uses[(s, c)] -= 1
                    if self._uses[(s, c)] == 0:
                        self._feats[(s, c)] = self._feats[(s, c)][:, :0]  # free, but remember it arrived
            for i, (t, kind) in enumerate(keys):
                out = from_features(y[..., i * width : (i + 1) * width], tg.kv_heads, tg.rope if kind == "k" else None, self._pos)
                part = self._partial.setdefault(t, {})
                part[kind] = out.to(self.out_dtype)
                if len(part) == 2:
                    del self._partial[t]
                    yield t, part["k"], part["v"]
        self._groups = remaining

    @property
    def done(self) -> bool:
        return not self._groups and not self._partial


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
