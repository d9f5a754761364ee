"""Closed-form centred ridge regression with held-out selection of lambda and source layers.

One eigendecomposition of the centred source Gram gives the ridge solution for every lambda
at once; the held-out error for each lambda comes from held-out Gram sums alone, without
revisiting data:  SSE(f) = tr(Hyy) - 2 f.(A∘P)1 + fᵀ(M∘AAᵀ)f,  f_i = 1/(e_i + lambda).
"""

from __future__ import annotations

from collections import OrderedDict
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


def _block(m: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """m[rows][:, cols] without first copying whole rows (the y side of a Gram can be 10k+ columns wide)."""
    return m.index_select(1, cols).index_select(0, rows)


def _centre(
    block: torch.Tensor,
    sum_rows: torch.Tensor,
    sum_cols: torch.Tensor,
    m_rows: torch.Tensor,
    m_cols: torch.Tensor,
    n: int,
) -> torch.Tensor:
    """A Gram block of (a - m_rows), (b - m_cols) from raw sums: Σabᵀ - (Σa) m_colsᵀ - m_rows (Σb)ᵀ + n m_rows
    m_colsᵀ."""
    return block - torch.outer(sum_rows, m_cols) - torch.outer(m_rows, sum_cols) + n * torch.outer(m_rows, m_cols)


class _XSide:
    """Everything about one source-column set that no target map changes: means, the centred train Gram's
    eigendecomposition, and the held-out Gram (and its diagonal second moments) in that eigenbasis."""

    def __init__(self, train: GramStats, heldout: GramStats, xi: torch.Tensor):
        self.xi, self._heldout = xi, heldout
        self.mx = train.sx[xi] / train.n
        sx = train.sx[xi]
        e, self.q = torch.linalg.eigh(_centre(_block(train.sxx, xi, xi), sx, sx, self.mx, self.mx, train.n))
        self.e = e.clamp(min=0)
        self.scale = float(self.e.mean()) or 1.0
        hs = heldout.sx[xi]
        self.m = self.q.T @ _centre(_block(heldout.sxx, xi, xi), hs, hs, self.mx, self.mx, heldout.n) @ self.q
        self._md: torch.Tensor | None = None

    @property
    def md(self) -> torch.Tensor:
        """qᵀ diag(E x²) q over the held-out rows: only bf16 fits (rounding > 0) need it, so it is made on first use."""
        if self._md is None:
            h = self._heldout
            self._md = self.q.T @ (self.q * (h.sxx.diagonal()[self.xi] / h.n)[:, None])
        return self._md

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.m, self._md) if t is not None)


class RidgeSolver:
    """Ridge paths and solutions over one pair of Gram sums, sharing the work that depends only on the source columns.

    The eigendecomposition of a candidate set's centred Gram is the expensive step (O(d³)); it is the same for
    every target map that tries that set, so it is computed once and kept (least recently used first out,
    within ``max_bytes``). Results are identical to solving each map on its own."""

    def __init__(self, train: GramStats, heldout: GramStats | None, max_bytes: int = 3 << 30):
        """``heldout`` None: no selection paths, only solves on ``train``."""
        self.train, self.heldout = train, heldout
        self._merged: GramStats | None = None
        self.max_bytes = max_bytes
        self._cache: OrderedDict[tuple, _XSide] = OrderedDict()
        self._bytes = 0
        self.decompositions = 0

    @property
    def merged(self) -> GramStats:
        """Train and held-out sums together, for the final solves (made on first use: a full copy of the sums)."""
        if self._merged is None:
            self._merged = self.train if self.heldout is None else self.train.merge(self.heldout)
        return self._merged

    def _side(self, xi: torch.Tensor) -> _XSide:
        key = ("path", tuple(xi.tolist()))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        side = _XSide(self.train, self.heldout, xi)
        self.decompositions += 1
        self._put(key, side)
        return side

    def _put(self, key, value) -> None:
        self._cache[key] = value
        self._bytes += value.nbytes()
        while self._bytes > self.max_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.nbytes()

    def heldout_r2_path(self, xi, yi, lambdas=DEFAULT_LAMBDAS, rounding: float = 0.0) -> torch.Tensor:
        """Held-out R² for every lambda in ``lambdas`` (same order); see :func:`heldout_r2_path`."""
        x = self._side(xi)
        train, heldout = self.train, self.heldout
        my = train.sy[yi] / train.n
        cxy = _centre(_block(train.sxy, xi, yi), train.sx[xi], train.sy[yi], x.mx, my, train.n)
        hxy = _centre(_block(heldout.sxy, xi, yi), heldout.sx[xi], heldout.sy[yi], x.mx, my, heldout.n)
        hyy = (heldout.syy[yi] - 2 * my * heldout.sy[yi] + heldout.n * my * my).sum()
        mh = heldout.sy[yi] / heldout.n
        sst = (heldout.syy[yi] - heldout.n * mh * mh).sum().clamp(min=1e-30)
        a, p = x.q.T @ cxy, x.q.T @ hxy
        r, g = (a * p).sum(1), a @ a.T
        mg = x.m * g
        mdg = x.md * g if rounding else None
        out = []
        for lam in lambdas:
            f = 1.0 / (x.e + lam * x.scale)
            sse = hyy - 2 * (f * r).sum() + f @ (mg @ f)
            if mdg is not None:
                sse = sse + rounding * heldout.n * (f @ (mdg @ f))
            out.append(1.0 - sse / sst)
        return torch.stack(out)

    def solve(self, xi, yi, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Weight and bias at relative lambda ``lam`` on all rows (train and held-out).

        One lambda needs no eigendecomposition: a Cholesky factor of the regularised centred Gram (kept per
        column set and lambda) solves it; the scale, the mean eigenvalue, is the trace over the dimension."""
        s = self.merged
        key = ("final", lam, tuple(xi.tolist()))
        hit = self._cache.get(key)
        if hit is None:
            sx = s.sx[xi]
            mx = sx / s.n
            cxx = _centre(_block(s.sxx, xi, xi), sx, sx, mx, mx, s.n)
            scale = float(cxx.diagonal().clamp(min=0).mean()) or 1.0
            factor, info = torch.linalg.cholesky_ex(cxx + lam * scale * torch.eye(len(xi), dtype=cxx.dtype))
            hit = _Final(mx, factor if int(info) == 0 else None, cxx, lam * scale)
            self._put(key, hit)
        else:
            self._cache.move_to_end(key)
        my = s.sy[yi] / s.n
        cxy = _centre(_block(s.sxy, xi, yi), s.sx[xi], s.sy[yi], hit.mx, my, s.n)
        if hit.factor is not None:
            w = torch.cholesky_solve(cxy, hit.factor)
        else:  # not positive definite at this lambda (rank-deficient inputs): the eigenbasis handles it
            e, q = torch.linalg.eigh(hit.cxx)
            w = q @ ((q.T @ cxy) / (e.clamp(min=0) + hit.ridge)[:, None])
        return w, my - hit.mx @ w


@dataclass
class _Final:
    mx: torch.Tensor
    factor: torch.Tensor | None
    cxx: torch.Tensor
    ridge: float

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.factor, self.cxx) if t is not None)


def rounding_variance(dtype: str) -> float:
    """Relative error variance that storing x and W in ``dtype`` adds to each product term: 2 u²/3 (u = unit
    roundoff)."""
    return {"float32": 0.0, "bfloat16": 2 * (2.0**-8) ** 2 / 3}[dtype]


def heldout_r2_path(
    train: GramStats, heldout: GramStats, xi, yi, lambdas=DEFAULT_LAMBDAS, rounding: float = 0.0
) -> torch.Tensor:
    """Held-out R² for every lambda in ``lambdas`` (same order).

    ``rounding`` > 0: the map will run with inputs and weights rounded to a short float (bfloat16), which adds
    noise of expected energy rounding * sum_i E[x_i²] |W_i|² per row; counting it steers the choice towards the
    larger lambdas whose smaller weights survive the rounding."""
    return RidgeSolver(train, heldout).heldout_r2_path(xi, yi, lambdas, rounding)


def solve(stats: GramStats, xi, yi, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias at relative lambda ``lam`` on all rows of ``stats``."""
    return RidgeSolver(stats, None).solve(xi, yi, lam)


def cols(layers: list[int] | tuple[int, ...], width: int) -> torch.Tensor:
    """Column indices of the given layers in a side-by-side feature layout."""
    return torch.cat([torch.arange(l * width, (l + 1) * width) for l in layers])


SELECTIONS = ("greedy", "ranked")


def select_and_fit(
    train: GramStats,
    heldout: GramStats,
    yi: torch.Tensor,
    blocks: dict[int, torch.Tensor],
    k: int,
    lambdas=DEFAULT_LAMBDAS,
    rounding: float = 0.0,
    solver: RidgeSolver | None = None,
    selection: str = "greedy",
    min_gain: float = 0.0,
) -> tuple[list[int], RidgeFit]:
    """Choose k candidate blocks (source layers) by held-out R², then refit on all rows.

    ``selection="greedy"``: forward selection, each step adding the block that helps most given those chosen
    (a decomposition per candidate set: up to C(L, k) of them across maps). ``"ranked"``: the k blocks with the
    best held-out R² on their own, then one path for the union (L + one decomposition per distinct union):
    for wide models, where greedy selection costs hours on a CPU.
    ``blocks`` maps a candidate (a source layer) to its x columns; the chosen blocks' columns are
    concatenated in ascending candidate order. ``min_gain`` > 0 (greedy only): stop before k once the best next block
    would raise held-out R² by less than that. Pass one ``solver`` for all maps over the same sums to share
    their eigendecompositions.
    """
    solver = solver or RidgeSolver(train, heldout)
    if selection == "ranked":
        single = {c: float(solver.heldout_r2_path(blocks[c], yi, lambdas, rounding).max()) for c in blocks}
        chosen = sorted(sorted(single, key=single.get, reverse=True)[: min(k, len(blocks))])
        path = solver.heldout_r2_path(torch.cat([blocks[c] for c in chosen]), yi, lambdas, rounding)
        i = int(torch.argmax(path))
        w, b = solver.solve(torch.cat([blocks[c] for c in chosen]), yi, lambdas[i])
        return chosen, RidgeFit(w, b, lambdas[i], float(path[i]))
    if selection != "greedy":
        raise ValueError(f"selection must be one of {SELECTIONS}")
    chosen: list[int] = []
    best_lam = lambdas[0]
    best_r2 = -float("inf")
    for _ in range(min(k, len(blocks))):
        trial = {}
        for cand in blocks:
            if cand in chosen:
                continue
            xi = torch.cat([blocks[c] for c in sorted([*chosen, cand])])
            path = solver.heldout_r2_path(xi, yi, lambdas, rounding)
            i = int(torch.argmax(path))
            trial[cand] = (float(path[i]), lambdas[i])
        cand, (r2, lam) = max(trial.items(), key=lambda kv: kv[1][0])
        if chosen and min_gain > 0 and r2 - best_r2 < min_gain:
            break
        chosen.append(cand)
        best_r2, best_lam = r2, lam
    chosen.sort()
    w, b = solver.solve(torch.cat([blocks[c] for c in chosen]), yi, best_lam)
    return chosen, RidgeFit(w, b, best_lam, best_r2)
