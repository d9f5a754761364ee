"""Reduced-rank regression: every source layer -> one shared low-rank code -> every target layer, in closed form.

The every-layer ridge map ``W`` (every source layer's K and V to every target layer's K and V, one lambda per target
map chosen by held-out R²) is the best closed form measured on the real pair, but it multiplies every source feature
into every target map. Its fitted values ``Xc W`` are close to low rank: projecting them onto their top ``r``
directions keeps nearly all of what it explains, and the projected map factors as ``E D`` with ``E`` [source
features, r] shared by every target map (:class:`kvferry.mappings.artifact.Basis`) and ``D`` [r, target features].

Each target map's columns are weighted by the inverse of its total variance before the projection, so every target
layer's K and V counts by its relative error (the mean R² the fit reports), not by its scale. With ``Cxx = Q diag(e)
Qᵀ`` the centred source Gram and ``P = Qᵀ Cxy``, in the eigenbasis ``W = Q (F∘P)`` and ``Cxx^½ W = Q (H∘P)`` with
``F = 1/(e + λ)`` and ``H = √e/(e + λ)`` per column's lambda; the top eigenvectors ``U`` (values ``s²``) of ``(H∘P) Ω
(H∘P)ᵀ`` give ``E = Q (F∘P) Ω (H∘P)ᵀ U / s`` and ``D = Uᵀ (H∘P) / s``, whose product is ``W``'s projection. Two
eigendecompositions of the source width, whatever the number of target maps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidInput
from .gram import GramStats


@dataclass
class ReducedRank:
    """A rank-``rank`` map: y = (x @ encoder + encoder_bias) @ decoder + decoder_bias (float64)."""

    encoder: torch.Tensor  # [dx, rank]
    encoder_bias: torch.Tensor  # [rank]
    decoder: torch.Tensor  # [rank, dy]
    decoder_bias: torch.Tensor  # [dy]

    def truncated(self, rank: int) -> ReducedRank:
        """The same fit at a lower rank (its leading directions: the fit's are ordered by what they explain)."""
        return ReducedRank(self.encoder[:, :rank], self.encoder_bias[:rank], self.decoder[:rank], self.decoder_bias)


def _centred(stats: GramStats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Means and centred sums (n times the covariances) of ``stats``."""
    n = stats.n
    mx, my = stats.sx / n, stats.sy / n
    cxx = stats.sxx - n * torch.outer(mx, mx)
    cxy = stats.sxy - n * torch.outer(mx, my)
    return mx, my, cxx, cxy


def reduced_rank(stats: GramStats, blocks: list[torch.Tensor], lambdas: list[float], rank: int) -> ReducedRank:
    """The rank-``rank`` projection of the every-source ridge map fitted on ``stats``.

    ``blocks``: each target map's columns of the y side (they partition it); ``lambdas``: each one's relative ridge
    strength (times the mean eigenvalue of the centred Gram, as :class:`kvferry.mappings.lab.ridge.RidgeSolver`)."""
    if len(blocks) != len(lambdas):
        raise InvalidInput("one lambda per target block")
    if not 1 <= rank <= min(stats.dx, stats.dy):
        raise InvalidInput(
            f"rank must be in 1..{min(stats.dx, stats.dy)} (the fewer of the source and target features), got {rank}"
        )
    mx, my, cxx, cxy = _centred(stats)
    e, q = torch.linalg.eigh(cxx)
    del cxx
    e = e.clamp(min=0)
    scale = float(e.mean()) or 1.0
    p = q.T @ cxy
    del cxy
    f = torch.empty_like(p)  # F∘P: the ridge map in the eigenbasis
    h = torch.empty_like(p)  # H∘P: Cxx^½ times it
    weights = torch.empty(stats.dy, dtype=torch.float64)
    var = (stats.syy - stats.n * my * my).clamp(min=0)
    for cols, lam in zip(blocks, lambdas):
        shrink = 1.0 / (e + lam * scale)
        f[:, cols] = p[:, cols] * shrink[:, None]
        h[:, cols] = p[:, cols] * (shrink * e.sqrt())[:, None]
        weights[cols] = 1.0 / float(var[cols].sum().clamp(min=1e-30))
    del p
    s2, u = torch.linalg.eigh((h * weights) @ h.T)
    order = torch.argsort(s2, descending=True)[:rank]
    order = order[s2[order] > 1e-12 * float(s2.max().clamp(min=1e-300))]  # directions the map does not use add nothing
    s = s2[order].clamp(min=1e-30).sqrt()
    u = u[:, order]
    hu = h.T @ u  # (H∘P)ᵀ U: [dy, rank]
    encoder = q @ (f @ (hu * weights[:, None])) / s
    decoder = hu.T / s[:, None]
    # codes of unit variance, so that no direction's scale depends on its singular value (the product is unchanged)
    code_sd = ((q.T @ encoder) ** 2 * e[:, None]).sum(0).div(stats.n).sqrt().clamp(min=1e-30)
    encoder, decoder = encoder / code_sd, decoder * code_sd[:, None]
    return ReducedRank(encoder, -(mx @ encoder), decoder, my)


def heldout_r2(
    fit: ReducedRank, train: GramStats, heldout: GramStats, blocks: list[torch.Tensor], ranks: list[int]
) -> dict[int, list[float]]:
    """Held-out R² of each target block at each rank in ``ranks`` (each at most the fit's), from held-out sums alone.

    Errors are measured about the fit's own means (its biases), the R²'s total about the held-out mean, as
    :class:`kvferry.mappings.lab.ridge.RidgeSolver` does."""
    n = heldout.n
    mx = train.sx / train.n
    my = fit.decoder_bias
    hxx = heldout.sxx - torch.outer(heldout.sx, mx) - torch.outer(mx, heldout.sx) + n * torch.outer(mx, mx)
    hxy = heldout.sxy - torch.outer(heldout.sx, my) - torch.outer(mx, heldout.sy) + n * torch.outer(mx, my)
    hyy = heldout.syy - 2 * my * heldout.sy + n * my * my
    mh = heldout.sy / n
    sst = heldout.syy - n * mh * mh
    b = fit.encoder.T @ hxy  # [R, dy]
    c = fit.encoder.T @ hxx @ fit.encoder  # [R, R]
    out = {}
    for r in ranks:
        d = fit.decoder[:r]
        cross = (d * b[:r]).sum(0)
        quad = (d * (c[:r, :r] @ d)).sum(0)
        sse = hyy - 2 * cross + quad
        out[r] = [float(1 - sse[cols].sum() / sst[cols].sum().clamp(min=1e-30)) for cols in blocks]
    return out
