"""Streaming Gram statistics: float64 sums whose size is independent of the corpus.

For one kind (K or V), ``x`` is every source layer's position-free features side by side
([N, Ls*ws]) and ``y`` every target layer's ([N, Lt*wt]). The sums add across batches and
across processes, so fitting can be sharded (see :func:`all_reduce`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GramStats:
    dx: int
    dy: int
    n: int = 0
    sx: torch.Tensor = field(default=None)
    sy: torch.Tensor = field(default=None)
    sxx: torch.Tensor = field(default=None)
    sxy: torch.Tensor = field(default=None)
    syy: torch.Tensor = field(default=None)  # per-dimension sum of squares (all SSE needs)

    def __post_init__(self) -> None:
        def z(*s):
            return torch.zeros(*s, dtype=torch.float64)

        self.sx = z(self.dx) if self.sx is None else self.sx
        self.sy = z(self.dy) if self.sy is None else self.sy
        self.sxx = z(self.dx, self.dx) if self.sxx is None else self.sxx
        self.sxy = z(self.dx, self.dy) if self.sxy is None else self.sxy
        self.syy = z(self.dy) if self.syy is None else self.syy

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Accumulate rows of x [N, dx] and y [N, dy]."""
        x = x.reshape(-1, self.dx).double().cpu()
        y = y.reshape(-1, self.dy).double().cpu()
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.sxx += x.T @ x
        self.sxy += x.T @ y
        self.syy += (y * y).sum(0)

    def merge(self, other: GramStats) -> GramStats:
        out = GramStats(self.dx, self.dy)
        out.n = self.n + other.n
        for name in ("sx", "sy", "sxx", "sxy", "syy"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [self.sx, self.sy, self.sxx, self.sxy, self.syy]


def all_reduce(stats: list[GramStats]) -> None:
    """Sum statistics across a torch.distributed group in place (no-op when not initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    counts = torch.tensor([float(s.n) for s in stats], dtype=torch.float64)
    dist.all_reduce(counts)
    for s, c in zip(stats, counts.tolist()):
        s.n = int(c)
        for t in s.tensors():
            dist.all_reduce(t)
