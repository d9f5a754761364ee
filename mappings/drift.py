"""The free drift signal: mapped KV against the target's own KV for the tail tokens it recomputes anyway.

When the target refreshes the last r prompt tokens on top of a mapped prefix, it produces its own K
and V for those tokens, and their queries. Comparing them with the mapped K and V of the same tokens
costs no model compute: per layer, the relative error of K and V, and the cosine between the
attention outputs the tail's queries get from the mapped and from the true tail (causal, within the
tail). A map that drifts from what the target would compute shows here before users notice. An engine that does
not expose its queries (vLLM's connector API) measures the K/V errors alone (``kv_drift``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cache import LayerKV
from .rope import RopeSpec, rotate


@dataclass(frozen=True)
class Drift:
    """Per target layer: relative error of K and V, and attention-output cosine (empty when the queries were not
    seen), over the compared tokens."""

    k_rel_err: tuple[float, ...]
    v_rel_err: tuple[float, ...]
    attn_cos: tuple[float, ...]
    tokens: int

    @property
    def mean_attn_cos(self) -> float | None:
        return sum(self.attn_cos) / len(self.attn_cos) if self.attn_cos else None

    @property
    def mean_rel_err(self) -> float:
        return (sum(self.k_rel_err) + sum(self.v_rel_err)) / (2 * len(self.k_rel_err))


class QueryTap:
    """Captures each attention layer's queries during a forward pass (hooks on q_proj; nothing recomputed).

    ``queries(positions)`` returns per layer [heads, T, head_dim] with the model's query norm (Qwen3) and
    RoPE applied, as the attention saw them. Works for the Llama-style classes kvferry supports. ``accept``: a
    forward pass is recorded only while it returns true (a server sharing the model between requests passes a
    check of the calling thread, so other requests' passes do not mix in)."""

    def __init__(self, model, rope: RopeSpec, accept: Callable[[], bool] | None = None):
        self.rope = rope
        self.accept = accept
        self.attn = [layer.self_attn for layer in model.model.layers]
        self.raw: list[torch.Tensor | None] = [None] * len(self.attn)
        self.handles = [a.q_proj.register_forward_hook(self._hook(i)) for i, a in enumerate(self.attn)]

    def _hook(self, i: int):
        def hook(module, args, output):
            if self.accept is None or self.accept():
                self.raw[i] = output.detach()

        return hook

    def queries(self, positions: range) -> list[torch.Tensor]:
        out = []
        for attn, q in zip(self.attn, self.raw):
            if q is None:
                raise RuntimeError("QueryTap saw no forward pass")
            d = self.rope.head_dim
            q = q[0].view(q.shape[1], -1, d)  # [T, heads, d]
            if getattr(attn, "q_norm", None) is not None:
                q = attn.q_norm(q)
            out.append(rotate(q.transpose(0, 1).float(), self.rope, positions))
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention within the tail: q [Hq, T, d], k/v [Hkv, T, d] -> [Hq, T, d]."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]


@torch.no_grad()
def tail_drift(mapped: list[LayerKV], true: list[LayerKV], queries: list[torch.Tensor]) -> Drift:
    """``mapped``/``true``: per layer (K, V) [1, kv_heads, T, head_dim] of the same tail tokens (post-RoPE keys);
    ``queries``: per layer [heads, T, head_dim] of those tokens (from QueryTap)."""
    cos = []
    for (mk, mv), (tk, tv), q in zip(mapped, true, queries):
        mk, mv, tk, tv = (x[0].float() for x in (mk, mv, tk, tv))
        a, b = _attend(q, mk, mv), _attend(q, tk, tv)
        cos.append(float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean()))
    errors = kv_drift(mapped, true)
    return Drift(errors.k_rel_err, errors.v_rel_err, tuple(cos), errors.tokens)


def _rel_err(mapped: torch.Tensor, true: torch.Tensor) -> float:
    true = true.float()
    return float((mapped.float() - true).norm() / true.norm().clamp(min=1e-12))


@torch.no_grad()
def kv_drift(mapped: list[LayerKV], true: list[LayerKV]) -> Drift:
    """The K/V relative errors alone (no attention cosine): ``mapped``/``true`` per layer (K, V)
    [1, kv_heads, T, head_dim] of the same tokens."""
    k_err = tuple(_rel_err(mk, tk) for (mk, _), (tk, _) in zip(mapped, true))
    v_err = tuple(_rel_err(mv, tv) for (_, mv), (_, tv) in zip(mapped, true))
    return Drift(k_err, v_err, (), int(true[0][0].shape[2]) if true else 0)
