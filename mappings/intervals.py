"""95% intervals over prompts for the measures the serving gate reads: percentile bootstrap, paired across arms.

A measure is a mean over prompts (top-10 overlap at the prompt's scored position, a copy prompt's accuracy), or a
ratio of two such means on the same prompts (copy kept: the served arm's mean accuracy over full prefill's). Resampling
draws prompts with replacement and keeps every arm of a drawn prompt together (paired), so an interval on a
difference or a ratio reflects how the arms move together, not two independent spreads. The resamples are seeded:
the same evidence always gives the same interval.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidInput

LEVEL = 0.95
RESAMPLES = 4000


@dataclass(frozen=True)
class Interval:
    """A point estimate and its interval (``low`` <= ``high``)."""

    value: float
    low: float
    high: float

    def holds(self, bar: float) -> bool:
        """Whether ``bar`` lies inside the interval (the data cannot say on which side of it the measure is)."""
        return self.low <= bar <= self.high

    def as_list(self) -> list[float]:
        return [round(self.low, 6), round(self.high, 6)]


def _draws(n: int, resamples: int, seed: int) -> torch.Tensor:
    """[resamples, n] prompt indices, drawn with replacement."""
    if n < 1:
        raise InvalidInput("an interval needs at least one prompt")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (resamples, n), generator=g)


def _bounds(stats: torch.Tensor, level: float) -> tuple[float, float]:
    stats = stats[torch.isfinite(stats)]
    if stats.numel() == 0:
        return float("nan"), float("nan")
    alpha = (1 - level) / 2
    q = torch.quantile(stats, torch.tensor([alpha, 1 - alpha], dtype=stats.dtype))
    return float(q[0]), float(q[1])


def mean_interval(values, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """The mean of per-prompt ``values`` and its bootstrap interval."""
    x = torch.as_tensor(values, dtype=torch.float64)
    idx = _draws(len(x), resamples, seed)
    return Interval(float(x.mean()), *_bounds(x[idx].mean(1), level))


def difference_interval(a, b, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """mean(a) - mean(b) over the same prompts (paired), and its interval."""
    x, y = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if x.shape != y.shape:
        raise InvalidInput(f"paired measures need one value per prompt on both sides; got {len(x)} and {len(y)}")
    idx = _draws(len(x), resamples, seed)
    return Interval(float(x.mean() - y.mean()), *_bounds(x[idx].mean(1) - y[idx].mean(1), level))


def ratio_interval(num, den, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """mean(num) / mean(den) over the same prompts (paired), and its interval; resamples whose denominator is 0 are
    left out."""
    x, y = torch.as_tensor(num, dtype=torch.float64), torch.as_tensor(den, dtype=torch.float64)
    if x.shape != y.shape:
        raise InvalidInput(f"paired measures need one value per prompt on both sides; got {len(x)} and {len(y)}")
    if float(y.mean()) == 0:
        raise InvalidInput("a ratio of means needs a denominator that is not zero on average")
    idx = _draws(len(x), resamples, seed)
    den_r = y[idx].mean(1)
    ratios = torch.where(
        den_r > 0, x[idx].mean(1) / den_r.clamp(min=1e-300), torch.tensor(float("nan"), dtype=torch.float64)
    )
    return Interval(float(x.mean() / y.mean()), *_bounds(ratios, level))


def half_width(iv: Interval) -> float:
    return (iv.high - iv.low) / 2
