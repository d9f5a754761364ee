"""Values matched to attention: refit each target layer's value map, given its mapped keys, so that the target's
attention outputs under its own queries match its full prefill's (Attention Matching, arXiv 2602.16284).

The closed-form fit asks each mapped value to equal the target's value token by token. What the target reads is
the attention output: per query head h, ``A_h V`` with ``A_h`` the causal softmax of its queries against the keys.
With the mapped keys, the target attends with ``Ã_h`` instead; the value map that makes ``Ã_h Ṽ`` closest to the
full prefill's ``A_h V`` absorbs part of the key error. ``Ṽ = X W + b`` is linear in the map's inputs ``X`` (a
shared-basis set's code, or the map's own source features), so with ``Z_h = Ã_h X`` (rows of ``Ã_h`` sum to 1, so
the bias passes through) the fit is a regression of ``A_h V`` on ``[Z_h, 1]``, pooled over the query heads that share
a KV head and over every query position: streaming Gram sums, one solve per layer, KV head and strength.

Attention rows average many tokens, so ``Z`` is far smoother than ``X`` and a free fit overfits (on the tiny family:
training error down by 60%, held-out error up by 30%). The fit is therefore pulled towards the closed-form map
``W0`` (``min ||Z W - O||² + λ ||W - W0||²``), and each layer's strength is chosen on held-out windows from a grid
that includes ``W0`` itself (λ = ∞): a layer keeps its closed-form values unless matching helps on windows it was
not fitted on.

Queries come from the target's full prefill of each window (QueryTap); windows should contain repeats
(``repeat_span``), so that the heads that copy a distant stretch are exercised. Keys are not changed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..apply import apply
from ..artifact import LayerMap, MapSet
from ..cache import LayerKV
from ..drift import QueryTap
from ..errors import InvalidInput
from ..features import to_features, window_inputs
from .capture import capture_kv
from .distill import with_repeat


@dataclass(frozen=True)
class MatchSettings:
    """How values are matched to attention."""

    lambdas: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
    """Strengths of the pull towards the closed-form values, relative to the mean diagonal of each solve's Gram; the
    held-out windows choose one per layer (or none: the closed form)."""
    repeat_span: int = 160
    """Every other window's last ``repeat_span`` tokens repeat an earlier stretch of it (0: no repeats)."""
    heldout_every: int = 5
    """Every n-th window is held out: the attention-output error is reported on those, before and after."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lambdas or not all(lam > 0 for lam in self.lambdas):
            raise InvalidInput(f"lambdas must be positive, got {self.lambdas}")
        if self.repeat_span < 0 or self.heldout_every < 2:
            raise InvalidInput("repeat_span must be >= 0 and heldout_every >= 2")


def map_inputs(ms: MapSet, source_kv: list[LayerKV]) -> dict[int, torch.Tensor]:
    """Per target layer, what its value map multiplies ([T, inputs], float32): a shared-basis set's code, or the map's
    own source features in LayerMap's column order."""
    rope = ms.source.geometry.rope
    n = source_kv[0][0].shape[2]
    cache: dict[tuple[int, str], torch.Tensor] = {}

    def feature(layer: int, kind: str) -> torch.Tensor:
        if (layer, kind) not in cache:
            x = source_kv[layer][0 if kind == "k" else 1].float()
            cache[(layer, kind)] = to_features(x, rope if kind == "k" else None, range(n))[0]
        return cache[(layer, kind)]

    out, by_sig = {}, {}
    for t in range(ms.target.geometry.layers):
        m = ms.maps[(t, "v")]
        sig = (m.source_layers, m.inputs, m.window)
        if sig not in by_sig:
            x = window_inputs(feature, *sig)
            if ms.basis is not None:
                x = x @ ms.basis.encoder.float() + ms.basis.bias.float()
            by_sig[sig] = x
        out[t] = by_sig[sig]
    return out


def _attention(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention weights [Hq, T, T] of queries q [Hq, T, d] against keys k [Hkv, T, d]."""
    group = q.shape[0] // k.shape[0]
    scores = q @ k.repeat_interleave(group, 0).transpose(1, 2) / q.shape[-1] ** 0.5
    mask = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1)


class _Sums:
    """Per target layer and KV head: Gram sums of [Z, 1], of [Z, 1] against the target's attention outputs O, and of
    O's squares: the squared error of any value map follows from them."""

    def __init__(self):
        self.g: dict[tuple[int, int], torch.Tensor] = {}
        self.c: dict[tuple[int, int], torch.Tensor] = {}
        self.oo: dict[tuple[int, int], float] = {}

    def add(self, layer: int, head: int, z: torch.Tensor, o: torch.Tensor) -> None:
        """``z`` [rows, inputs] (Ã X over one KV head's query heads and positions), ``o`` [rows, head_dim]."""
        za = torch.cat([z, z.new_ones(z.shape[0], 1)], 1).double()
        key = (layer, head)
        g, c = za.T @ za, za.T @ o.double()
        self.g[key] = g if key not in self.g else self.g[key] + g
        self.c[key] = c if key not in self.c else self.c[key] + c
        self.oo[key] = self.oo.get(key, 0.0) + float((o.double() ** 2).sum())

    def sse(self, key: tuple[int, int], w: torch.Tensor) -> float:
        """Squared error of the (bias-augmented) value map ``w`` [inputs + 1, head_dim] on these sums."""
        return float((w * (self.g[key] @ w)).sum() - 2 * (w * self.c[key]).sum()) + self.oo[key]


def _pulled(train: _Sums, key: tuple[int, int], w0: torch.Tensor, lam: float) -> torch.Tensor:
    """argmin ||Z W - O||² + lam * s ||W - w0||² on ``train``'s sums (s: the Gram's mean diagonal)."""
    g = train.g[key]
    ridge = lam * float(g.diagonal().mean())
    return torch.linalg.solve(g + ridge * torch.eye(g.shape[0], dtype=g.dtype), train.c[key] + ridge * w0)


@torch.no_grad()
def match_values(
    ms: MapSet,
    source,
    target,
    windows: list[torch.Tensor],
    s: MatchSettings | None = None,
    version: str | None = None,
    progress=None,
) -> tuple[MapSet, dict]:
    """``ms`` with every value map refitted to the target's attention outputs under its mapped keys; returns it and a
    record (settings, windows, per layer the held-out relative attention-output error before and after)."""
    s = s or MatchSettings()
    tg = ms.target.geometry
    if len(windows) < s.heldout_every:
        raise InvalidInput(
            f"attention matching needs at least {s.heldout_every} windows (one held out); got {len(windows)}"
        )
    rng = random.Random(s.seed)
    train, held = _Sums(), _Sums()
    say = progress or (lambda _: None)
    for i, ids in enumerate(windows):
        if s.repeat_span and i % 2 == 1:
            if len(ids) <= 2 * s.repeat_span + 64:
                raise InvalidInput(f"windows of {len(ids)} tokens are too short for a repeat of {s.repeat_span}")
            ids = with_repeat(ids, s.repeat_span, rng)
        skv = capture_kv(source.model, ids[None])
        mapped = apply(ms, skv, 0)
        tap = QueryTap(target.model, tg.rope)
        try:
            true = capture_kv(target.model, ids[None])
            queries = tap.queries(range(len(ids)))
        finally:
            tap.close()
        x = map_inputs(ms, skv)
        sums = held if i % s.heldout_every == 0 else train
        group = queries[0].shape[0] // tg.kv_heads
        for t in range(tg.layers):
            a_mapped = _attention(queries[t], mapped[t][0][0].float())
            a_true = _attention(queries[t], true[t][0][0].float())
            v = true[t][1][0].float()
            for h in range(tg.kv_heads):
                heads = range(h * group, (h + 1) * group)
                sums.add(
                    t, h, torch.cat([a_mapped[j] @ x[t] for j in heads]), torch.cat([a_true[j] @ v[h] for j in heads])
                )
        say(f"window {i + 1}/{len(windows)}")
    hd = tg.head_dim
    maps, chosen, before, after = dict(ms.maps), [], [], []
    for t in range(tg.layers):
        m = ms.maps[(t, "v")]
        w0 = {
            h: torch.cat([m.weight[:, h * hd : (h + 1) * hd], m.bias[None, h * hd : (h + 1) * hd]]).double()
            for h in range(tg.kv_heads)
        }
        norm = sum(held.oo[(t, h)] for h in range(tg.kv_heads))
        closed = sum(held.sse((t, h), w0[h]) for h in range(tg.kv_heads))
        best = (closed, None)
        for lam in s.lambdas:
            err = sum(held.sse((t, h), _pulled(train, (t, h), w0[h], lam)) for h in range(tg.kv_heads))
            best = min(best, (err, lam), key=lambda e: e[0])
        before.append((closed / norm) ** 0.5)
        after.append((best[0] / norm) ** 0.5)
        chosen.append(best[1])
        if best[1] is None:
            continue  # matching does not help this layer on held-out windows: its closed-form values stay
        both = _Sums()
        for key in [(t, h) for h in range(tg.kv_heads)]:
            both.g[key], both.c[key] = train.g[key] + held.g[key], train.c[key] + held.c[key]
        weight, bias = m.weight.float().clone(), m.bias.float().clone()
        for h in range(tg.kv_heads):
            w = _pulled(both, (t, h), w0[h], best[1])
            weight[:, h * hd : (h + 1) * hd], bias[h * hd : (h + 1) * hd] = w[:-1].float(), w[-1].float()
        maps[(t, "v")] = LayerMap(
            t,
            "v",
            m.source_layers,
            weight.to(m.weight.dtype),
            bias.to(m.bias.dtype),
            m.lam,
            float("nan"),
            m.inputs,
            m.window,
        )
    record = {
        "lambdas": list(s.lambdas),
        "repeat_span": s.repeat_span,
        "seed": s.seed,
        "windows": sum(1 for i in range(len(windows)) if i % s.heldout_every),
        "seq_len": int(windows[0].shape[0]),
        "held_windows": sum(1 for i in range(len(windows)) if i % s.heldout_every == 0),
        "chosen_lambda": chosen,
        "heldout_attn_rel_err_before": [round(e, 5) for e in before],
        "heldout_attn_rel_err_after": [round(e, 5) for e in after],
        "base_version": ms.version,
    }
    out = MapSet(
        ms.source,
        ms.target,
        maps,
        version or ms.version,
        dict(ms.fit) | {"attention_matched": record},
        dict(ms.calibration),
        basis=ms.basis,
    )
    return out, record
