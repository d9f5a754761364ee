"""Serving gates: a map serves only with measured evidence at or above these thresholds."""

from __future__ import annotations

from dataclasses import dataclass

from .artifact import MapSet
from .errors import GateFailed, InvalidInput


@dataclass(frozen=True)
class Gates:
    """Thresholds on the evidence of the arm a deployment serves (by default mapped + refresh)."""

    arm: str = "mapped_refresh"
    """Which evaluated arm the gates apply to: the path serving will actually take."""
    min_top10: float = 0.8
    """Minimum next-token top-10 overlap with the target's full prefill."""
    min_top1: float = 0.0
    """Minimum next-token top-1 agreement."""
    max_kl: float = float("inf")
    """Maximum mean KL(full prefill || mapped)."""
    min_attn_cos: float = 0.0
    """Minimum mean attention-output cosine."""
    min_copy_retention: float = 0.85
    """Long-range gate (on by default; 0 turns it off): at every copy-probe gap, the served arm's copy accuracy
    must be at least this share of the target's own (full prefill). Next-token metrics cannot see a map that
    loses a distant passage; this can."""
    min_copy_full: float = 0.5
    """A gap where the target's own copy accuracy is below this is not applicable: the target shows no
    long-range skill there to lose (the tiny test family), so it neither passes nor fails the map."""

    max_completion_drop: float = 0.02
    """Downstream gate, read where the evidence has the completion task: the served arm's exact-match rate may
    fall at most this far below the target's own (full prefill)."""

    def __post_init__(self) -> None:
        if not (0 <= self.min_top10 <= 1 and 0 <= self.min_top1 <= 1 and -1 <= self.min_attn_cos <= 1):
            raise InvalidInput("gate fractions must lie in [0, 1] (attention cosine in [-1, 1])")
        if self.max_kl < 0:
            raise InvalidInput("max_kl must be >= 0")
        if not 0 <= self.max_completion_drop <= 1:
            raise InvalidInput("max_completion_drop must lie in [0, 1]")
        if not (0 <= self.min_copy_retention <= 1 and 0 <= self.min_copy_full <= 1):
            raise InvalidInput("min_copy_retention and min_copy_full must lie in [0, 1]")

    def failures(self, evidence: dict | None) -> list[str]:
        """Reasons the evidence fails; empty when it passes. Every domain the evidence holds is read (code, and
        English prose when it was measured): a map passes only where its worst domain passes."""
        if not evidence or "arms" not in evidence:
            return ["the map has no evaluation evidence; run `kvferry eval` on it first"]
        out = []
        for domain, ev in domains(evidence):
            row = ev.get("arms", {}).get(self.arm)
            if row is None:
                out.append(f"the {domain} evidence has no {self.arm!r} arm; re-run `kvferry eval`")
                continue
            for key, bound, ok in (("top10", self.min_top10, lambda v, b: v >= b), ("top1", self.min_top1, lambda v, b: v >= b),
                                   ("kl", self.max_kl, lambda v, b: v <= b), ("attn_cos", self.min_attn_cos, lambda v, b: v >= b)):
                value = row.get(key)
                if value is None and domain != "code" and key not in _PROSE_METRICS:
                    continue  # prose is scored on the next-token metrics alone
                if value is None or not ok(value, bound):
                    shown = f"{value:.3f}" if isinstance(value, float) else value
                    where = "" if domain == "code" else f"{domain}: "
                    out.append(f"{where}{self.arm} {key}={shown} fails the gate ({'<=' if key == 'kl' else '>='} {bound})")
        return out + self.copy_failures(evidence) + self.completion_failures(evidence)

    def completion_failures(self, evidence: dict) -> list[str]:
        """The downstream gate alone (empty when the evidence has no completion task)."""
        arms = (evidence.get("completion") or {}).get("arms")
        if not arms:
            return []
        full, got = arms.get("full"), arms.get(self.arm)
        if full is None or got is None:
            return [f"the completion task has no full or {self.arm!r} arm; re-run `kvferry eval`"]
        if got < full - self.max_completion_drop:
            return [f"completion: {self.arm} writes {got:.3f} of the lines exactly, full prefill {full:.3f} (gate: within "
                    f"{self.max_completion_drop:.2f}; truncation {arms.get('truncate', float('nan')):.3f})"]
        return []

    def copy_failures(self, evidence: dict) -> list[str]:
        """The long-range gate alone: reasons the copy-probe evidence fails (empty when it passes or is off). The code
        domain's probe is required; a prose probe, where measured, must pass too."""
        if self.min_copy_retention <= 0:
            return []
        copy = evidence.get("copy")
        if not copy or not copy.get("gaps"):
            return ["the map has no long-range (copy probe) evidence; re-run `kvferry eval` on it"]
        out = []
        for domain, ev in domains(evidence):
            where = "" if domain == "code" else f"{domain}: "
            for gap, row in sorted((ev.get("copy") or {}).get("gaps", {}).items(), key=lambda kv: int(kv[0])):
                full, got = row.get("full"), row.get(self.arm)
                if full is None or got is None:
                    out.append(f"{where}the copy probe at gap {gap} has no {self.arm!r} arm; re-run `kvferry eval`")
                elif full >= self.min_copy_full and got < self.min_copy_retention * full:
                    out.append(f"{where}long-range copy at gap {gap}: {self.arm} {got:.3f} keeps {got / full:.0%} of full "
                               f"prefill's {full:.3f} (gate: >= {self.min_copy_retention:.0%}; truncation scores "
                               f"{row.get('truncate', float('nan')):.3f})")
        return out

    def verdict(self, evidence: dict | None, force: bool = False) -> tuple[bool, list[str]]:
        """The one answer to "may this map serve?": (serves, the gate failures). ``force`` serves it anyway (testing)."""
        problems = self.failures(evidence)
        return (not problems or force), problems

    def check(self, ms: MapSet, force: bool = False) -> None:
        """Raise GateFailed for a map that may not serve, unless ``force``."""
        serves, problems = self.verdict(ms.evidence, force)
        if not serves:
            raise GateFailed(f"map {ms.name} {ms.version} is gated off: " + "; ".join(problems) +
                             ". Improve the map, lower the gates deliberately, or force it for testing.")


_PROSE_METRICS = ("top10", "top1", "kl")


def domains(evidence: dict) -> list[tuple[str, dict]]:
    """The evidence's domains as (name, evidence of that domain): "code" (the top level), then "prose" if measured."""
    out = [("code", evidence)]
    if isinstance(evidence.get("prose"), dict):
        out.append(("prose", evidence["prose"]))
    return out


def load_for_serving(path, gates: Gates | None = None, force: bool = False, expect_source=None, expect_target=None) -> MapSet:
    """Load and verify an artifact, then refuse it unless its evidence passes ``gates`` (or ``force``)."""
    from .artifact import load

    ms = load(path, expect_source, expect_target)
    (gates or Gates()).check(ms, force=force)
    return ms
