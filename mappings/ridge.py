"""Closed-form centred ridge regression with held-out selection of lambda and source layers.

One eigendecomposition of the centred source Gram gives the ridge solution for every lambda
at once; the held-out error for each lambda comes from held-out Gram sums alone, without
revisiting data:  SSE(f) = tr(Hyy) - 2 f.(A∘P)1 + fᵀ(M∘AAᵀ)f,  f_i = 1/(e_i + lambda).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gram import GramStats

# Relative to the mean eigenvalue of the centred Gram, so the grid is scale-free.
DEFAULT_LAMBDAS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)


@dataclass
class RidgeFit:
    weight: torch.Tensor  # [dx_sel, dy_sel] float64
    bias: torch.Tensor  # [dy_sel]
    lam: float  # relative lambda
    heldout_r2: float


def _centred(s: GramStats, xi: torch.Tensor, yi: torch.Tensor, mx: torch.Tensor, my: torch.Tensor):
    """Gram blocks of (x - mx), (y - my) over the rows in s."""
    sx, sy = s.sx[xi], s.sy[yi]
    cxx = s.sxx[xi][:, xi] - torch.outer(sx, mx) - torch.outer(mx, sx) + s.n * torch.outer(mx, mx)
    cxy = s.sxy[xi][:, yi] - torch.outer(sx, my) - torch.outer(mx, sy) + s.n * torch.outer(mx, my)
    yy = (s.syy[yi] - 2 * my * sy + s.n * my * my).sum()
    return cxx, cxy, yy


def _solve_path(train: GramStats, xi: torch.Tensor, yi: torch.Tensor):
    mx, my = train.sx[xi] / train.n, train.sy[yi] / train.n
    cxx, cxy, _ = _centred(train, xi, yi, mx, my)
    e, q = torch.linalg.eigh(cxx)
    e = e.clamp(min=0)
    scale = float(e.mean()) or 1.0
    return mx, my, e, q, q.T @ cxy, scale


def rounding_variance(dtype: str) -> float:
    """Relative error variance that storing x and W in ``dtype`` adds to each product term: 2 u²/3 (u = unit roundoff)."""
    return {"float32": 0.0, "bfloat16": 2 * (2.0 ** -8) ** 2 / 3}[dtype]


def heldout_r2_path(train: GramStats, heldout: GramStats, xi, yi, lambdas=DEFAULT_LAMBDAS, rounding: float = 0.0) -> torch.Tensor:
    """Held-out R² for every lambda in ``lambdas`` (same order).

    ``rounding`` > 0: the map will run with inputs and weights rounded to a short float (bfloat16), which adds
    noise of expected energy rounding * sum_i E[x_i²] |W_i|² per row; counting it steers the choice towards the
    larger lambdas whose smaller weights survive the rounding."""
    mx, my, e, q, a, scale = _solve_path(train, xi, yi)
    hxx, hxy, hyy = _centred(heldout, xi, yi, mx, my)
    mh = heldout.sy[yi] / heldout.n
    sst = (heldout.syy[yi] - heldout.n * mh * mh).sum().clamp(min=1e-30)
    m, p = q.T @ hxx @ q, q.T @ hxy
    r, g = (a * p).sum(1), a @ a.T
    md = q.T @ (q * (heldout.sxx.diagonal()[xi] / heldout.n)[:, None]) if rounding else None  # qᵀ diag(E x²) q
    out = []
    for lam in lambdas:
        f = 1.0 / (e + lam * scale)
        sse = hyy - 2 * (f * r).sum() + f @ ((m * g) @ f)
        if md is not None:
            sse = sse + rounding * heldout.n * (f @ ((md * g) @ f))
        out.append(1.0 - sse / sst)
    return torch.stack(out)


def solve(stats: GramStats, xi, yi, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias at relative lambda ``lam`` on all rows of ``stats``."""
    mx, my, e, q, a, scale = _solve_path(stats, xi, yi)
    w = q @ (a / (e + lam * scale)[:, None])
    return w, my - mx @ w


def cols(layers: list[int] | tuple[int, ...], width: int) -> torch.Tensor:
    """Column indices of the given layers in a side-by-side feature layout."""
    return torch.cat([torch.arange(l * width, (l + 1) * width) for l in layers])


def select_and_fit(train: GramStats, heldout: GramStats, yi: torch.Tensor, blocks: dict[int, torch.Tensor], k: int,
                   lambdas=DEFAULT_LAMBDAS, rounding: float = 0.0) -> tuple[list[int], RidgeFit]:
    """Greedy forward selection of k candidate blocks (source layers) by held-out R², then a refit on all rows.

    ``blocks`` maps a candidate (a source layer) to its x columns; the chosen blocks' columns are
    concatenated in ascending candidate order.
    """
    chosen: list[int] = []
    best_lam = lambdas[0]
    best_r2 = -float("inf")
    for _ in range(min(k, len(blocks))):
        trial = {}
        for cand in blocks:
            if cand in chosen:
                continue
            xi = torch.cat([blocks[c] for c in sorted(chosen + [cand])])
            path = heldout_r2_path(train, heldout, xi, yi, lambdas, rounding)
            i = int(torch.argmax(path))
            trial[cand] = (float(path[i]), lambdas[i])
        cand, (r2, lam) = max(trial.items(), key=lambda kv: kv[1][0])
        chosen.append(cand)
        best_r2, best_lam = r2, lam
    chosen.sort()
    w, b = solve(train.merge(heldout), torch.cat([blocks[c] for c in chosen]), yi, best_lam)
    return chosen, RidgeFit(w, b, best_lam, best_r2)
