"""95% intervals over prompts (mappings/intervals.py) and the gate's marginal verdicts (mappings/gates.py)."""

import math
import random

import pytest
import torch

from kvferry.mappings.errors import InvalidInput
from kvferry.mappings.gates import Gates
from kvferry.mappings.intervals import difference_interval, mean_interval, ratio_interval


def test_a_mean_interval_matches_the_normal_one_and_covers_the_truth():
    """Against a known distribution: Bernoulli(0.8) prompts. The bootstrap interval's width is the normal
    approximation's (1.96 standard errors each side, within 15%), and over 200 independent samples the interval holds
    the true mean close to 95% of the time."""
    rng = random.Random(0)
    n, p = 200, 0.8
    sample = [float(rng.random() < p) for _ in range(n)]
    iv = mean_interval(sample, resamples=4000)
    mean = sum(sample) / n
    normal = 1.96 * math.sqrt(mean * (1 - mean) / n)
    assert iv.value == pytest.approx(mean)
    assert (iv.high - iv.low) / 2 == pytest.approx(normal, rel=0.15)
    covered = 0
    for seed in range(200):
        r = random.Random(seed + 1)
        xs = [float(r.random() < p) for _ in range(60)]
        covered += mean_interval(xs, resamples=1000, seed=seed).holds(p)
    assert 0.88 <= covered / 200 <= 0.99


def test_paired_intervals_see_what_the_arms_share():
    """Two arms that move together prompt by prompt: their difference is known far better than either arm alone, and
    an arm against itself has a ratio of exactly 1."""
    g = torch.Generator().manual_seed(0)
    base = torch.rand(40, generator=g)
    other = base - 0.05 + 0.01 * torch.randn(40, generator=g)
    alone = mean_interval(other.tolist())
    diff = difference_interval(base.tolist(), other.tolist())
    assert diff.holds(0.05) and diff.high - diff.low < 0.2 * (alone.high - alone.low)
    same = ratio_interval(base.tolist(), base.tolist())
    assert same.value == same.low == same.high == pytest.approx(1.0)
    assert mean_interval([0.5] * 5) == mean_interval([0.5] * 5)  # seeded: the same evidence, the same interval


def test_intervals_refuse_what_they_cannot_measure():
    with pytest.raises(InvalidInput, match="at least one prompt"):
        mean_interval([])
    with pytest.raises(InvalidInput, match="one value per prompt"):
        difference_interval([1, 2], [1])
    with pytest.raises(InvalidInput, match="not zero"):
        ratio_interval([1, 0], [0, 0])


def _copy_evidence(full: list[float], served: list[float]) -> dict:
    per = [{"full": f, "truncate": 0.3, "mapped": s, "mapped_refresh": s} for f, s in zip(full, served)]
    row = {arm: sum(p[arm] for p in per) / len(per) for arm in ("full", "truncate", "mapped", "mapped_refresh")}
    return {
        "arms": {"mapped_refresh": {"top10": 0.9, "top1": 0.9, "kl": 0.1, "attn_cos": 0.9}},
        "copy": {"gaps": {"500": row | {"per_prompt": per}}},
    }


def test_the_gate_names_a_measure_whose_bar_lies_inside_its_interval_marginal():
    """Copy kept 0.87 on prompts that scatter widely: the 0.85 bar lies inside its interval. The default policy refuses
    it, "serve" lets it pass; the same 0.87 on prompts that agree passes either way, and 0.70 on them fails either
    way."""
    wide = _copy_evidence([1.0] * 12, [1.0, 0.5, 1.0, 0.95, 0.6, 1.0, 0.9, 1.0, 0.75, 1.0, 0.8, 0.94])
    assert sum(p["mapped_refresh"] for p in wide["copy"]["gaps"]["500"]["per_prompt"]) / 12 == pytest.approx(0.87)
    refuse, serve = Gates(), Gates(marginal="serve")
    (check,) = refuse.marginal_checks(wide)
    assert check.measure == "copy kept at gap 500" and check.passes and check.interval.low < 0.85 < check.interval.high
    problems = refuse.failures(wide)
    assert len(problems) == 1 and "marginal" in problems[0] and "the bar lies inside it" in problems[0]
    assert serve.failures(wide) == []
    tight = _copy_evidence([1.0] * 12, [0.87] * 12)
    assert refuse.failures(tight) == [] and refuse.marginal_checks(tight) == []
    low = _copy_evidence([1.0] * 12, [0.7] * 12)
    assert len(refuse.failures(low)) == len(serve.failures(low)) == 1
    with pytest.raises(InvalidInput, match="marginal must be one of"):
        Gates(marginal="maybe")


def test_next_token_measures_get_intervals_from_per_prompt_scores():
    ev = _copy_evidence([1.0] * 12, [0.95] * 12)
    ev["arms"]["mapped_refresh"]["top10"] = 0.81
    ev["arms"]["mapped_refresh"]["per_prompt"] = {"top10": [0.6, 1.0, 0.9, 0.7, 0.8, 0.9, 0.7, 1.0, 0.8, 0.7]}
    (check,) = Gates().marginal_checks(ev)
    assert check.measure == "mapped_refresh top10" and check.interval.holds(0.8)
    assert Gates(marginal="serve").failures(ev) == []


def test_evidence_without_per_prompt_data_is_judged_by_its_point_estimates():
    ev = _copy_evidence([1.0] * 3, [0.84] * 3)
    for row in ev["copy"]["gaps"].values():
        row.pop("per_prompt")
    assert Gates().marginal_checks(ev) == [] and len(Gates(marginal="serve").failures(ev)) == 1


def test_the_sidecar_and_the_chart_carry_the_marginal_policy():
    from kvferry.sidecar.config import SidecarConfig

    assert SidecarConfig().gates.marginal == "refuse"
    assert SidecarConfig(gate_marginal="serve").gates.marginal == "serve"
    with pytest.raises(InvalidInput, match="marginal must be one of"):
        SidecarConfig(gate_marginal="sometimes")
