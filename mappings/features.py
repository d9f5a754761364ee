"""Position-free per-token features of a cache layer: what the maps read and write."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .rope import RopeSpec, rotate, unrotate


def to_features(
    kv: torch.Tensor,
    spec: RopeSpec | None,
    positions: torch.Tensor | range,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, H, T, D] cache tensor -> [B, T, H*D] in ``dtype`` (written into ``out`` when given, a [B, T, H*D] tensor or
    view); keys (spec given) are un-rotated first, in float32.

    The head/token transpose and the cast happen in one pass."""
    x = unrotate(kv, spec, positions) if spec is not None else kv
    b, h, t, d = x.shape
    out = torch.empty(b, t, h * d, dtype=dtype, device=x.device) if out is None else out
    out.view(b, t, h, d).copy_(x.transpose(1, 2))
    return out


def from_features(x: torch.Tensor, heads: int, spec: RopeSpec | None, positions: torch.Tensor | range) -> torch.Tensor:
    """[B, T, H*D] -> [B, H, T, D]; keys (spec given) are rotated at ``positions``."""
    b, t, w = x.shape
    kv = x.reshape(b, t, heads, w // heads).transpose(1, 2)
    return rotate(kv, spec, positions) if spec is not None else kv


def window_inputs(feature: Callable[[int, str], torch.Tensor], sources, inputs, window: int) -> torch.Tensor:
    """[T, window * len(sources) * len(inputs) * width]: what a map reads, in LayerMap's column order (offset 0, 1, ...
    back, then source layers, then inputs), zeros before the first token; ``feature(layer, kind)`` gives one source
    layer's position-free K or V, [T, width]."""
    per = torch.cat([feature(s, c) for s in sources for c in inputs], -1)
    return torch.cat([per] + [torch.cat([per.new_zeros(o, per.shape[1]), per[:-o]], 0) for o in range(1, window)], -1)
