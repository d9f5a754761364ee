"""Serving gates: a map serves only with measured evidence at or above these thresholds."""

from __future__ import annotations

from dataclasses import dataclass

from .artifact import MapSet
from .errors import GateFailed, InvalidInput
from .gate_bars import GATE_ARM, MARGINAL, MAX_COMPLETION_DROP, MAX_KL, MIN_COPY_RETENTION, MIN_TOP10
from .intervals import Interval, difference_interval, mean_interval, ratio_interval

MARGINAL_POLICIES = ("refuse", "serve")


@dataclass(frozen=True)
class Check:
    """One gated measure: its point estimate against its bar, with its 95% interval where per-prompt data exist."""

    where: str
    """The domain ("code", "prose"), or the downstream task ("completion", "next line")."""
    measure: str
    value: float | None
    bar: float
    at_least: bool
    """The value must be at least the bar (else at most)."""
    interval: Interval | None = None
    note: str = ""
    """How a failure is explained (default: the measure, its value and its bar)."""

    @property
    def passes(self) -> bool:
        return self.value is not None and (self.value >= self.bar if self.at_least else self.value <= self.bar)

    @property
    def marginal(self) -> bool:
        return self.interval is not None and self.interval.holds(self.bar)

    def message(self) -> str:
        where = "" if self.where in ("code", "completion") else f"{self.where}: "
        shown = f"{self.value:.3f}" if isinstance(self.value, float) else self.value
        op = ">=" if self.at_least else "<="
        if self.passes:
            text = f"{where}{self.measure}={shown} passes its bar ({op} {self.bar}) but is marginal"
        else:
            text = self.note or f"{where}{self.measure}={shown} fails the gate ({op} {self.bar})"
        if self.interval is not None:
            text += f" [95% interval {self.interval.low:.3f} to {self.interval.high:.3f}" + (
                ": the bar lies inside it]" if self.marginal else "]"
            )
        return text


@dataclass(frozen=True)
class Gates:
    """Thresholds on the evidence of the arm a deployment serves (by default mapped + refresh)."""

    arm: str = GATE_ARM
    """Which evaluated arm the gates apply to: the path serving will actually take."""
    min_top10: float = MIN_TOP10
    """Minimum next-token top-10 overlap with the target's full prefill."""
    min_top1: float = 0.0
    """Minimum next-token top-1 agreement."""
    max_kl: float = MAX_KL
    """Maximum mean KL(full prefill || mapped)."""
    min_attn_cos: float = 0.0
    """Minimum mean attention-output cosine."""
    min_copy_retention: float = MIN_COPY_RETENTION
    """Long-range gate (on by default; 0 turns it off): at every copy-probe gap, the served arm's copy accuracy
    must be at least this share of the target's own (full prefill). Next-token metrics cannot see a map that
    loses a distant passage; this can."""
    min_copy_full: float = 0.5
    """A gap where the target's own copy accuracy is below this is not applicable: the target shows no
    long-range skill there to lose (the tiny test family), so it neither passes nor fails the map."""

    max_completion_drop: float = MAX_COMPLETION_DROP
    """Downstream gate: the served arm's score may fall at most this far below the target's own (full prefill), on
    the next-line task's edit similarity where the evidence has it, else on the completion task's exact-match rate."""
    marginal: str = MARGINAL
    """What a marginal measure does, one whose bar lies inside its 95% interval over prompts (the data cannot say
    which side of the bar the map is on): "refuse" (the default) blocks the map, as a failure does; "serve" lets it
    pass, whichever side its point estimate is on. A measure whose whole interval misses the bar fails either way; one
    recorded without per-prompt data (no interval) is judged by its point estimate."""

    def __post_init__(self) -> None:
        if not (0 <= self.min_top10 <= 1 and 0 <= self.min_top1 <= 1 and -1 <= self.min_attn_cos <= 1):
            raise InvalidInput("gate fractions must lie in [0, 1] (attention cosine in [-1, 1])")
        if self.max_kl < 0:
            raise InvalidInput("max_kl must be >= 0")
        if not 0 <= self.max_completion_drop <= 1:
            raise InvalidInput("max_completion_drop must lie in [0, 1]")
        if not (0 <= self.min_copy_retention <= 1 and 0 <= self.min_copy_full <= 1):
            raise InvalidInput("min_copy_retention and min_copy_full must lie in [0, 1]")
        if self.marginal not in MARGINAL_POLICIES:
            raise InvalidInput(f"marginal must be one of {MARGINAL_POLICIES}, got {self.marginal!r}")

    def failures(self, evidence: dict | None) -> list[str]:
        """Reasons the evidence fails; empty when it passes. Every domain the evidence holds is read (code, and
        English prose when it was measured): a map passes only where its worst domain passes. A measure whose bar lies
        inside its 95% interval is *marginal*: it blocks the map or not as ``marginal`` says, whichever side of the bar
        its point estimate is on."""
        if not evidence or "arms" not in evidence:
            return ["the map has no evaluation evidence; run `kvferry eval` on it first"]
        problems, checks = self.checks(evidence)
        return problems + [c.message() for c in checks if self.blocks(c)]

    def blocks(self, check: Check) -> bool:
        """Whether one measured check keeps the map from serving, under the marginal policy."""
        if check.marginal:
            return self.marginal == "refuse"
        return not check.passes

    def marginal_checks(self, evidence: dict | None) -> list[Check]:
        """The measures whose bar lies inside their interval (what the verdict names as marginal)."""
        return [c for c in self.checks(evidence)[1] if c.marginal] if evidence and "arms" in evidence else []

    def checks(self, evidence: dict) -> tuple[list[str], list[Check]]:
        """Every gated measure of the evidence as a Check (value, bar, interval where per-prompt data exist), and the
        structural problems (an arm or a probe missing) that fail the map whatever the numbers."""
        problems: list[str] = []
        checks: list[Check] = []
        for domain, ev in domains(evidence):
            row = ev.get("arms", {}).get(self.arm)
            if row is None:
                problems.append(f"the {domain} evidence has no {self.arm!r} arm; re-run `kvferry eval`")
                continue
            per = row.get("per_prompt") or {}
            for key, bound, at_least in (
                ("top10", self.min_top10, True),
                ("top1", self.min_top1, True),
                ("kl", self.max_kl, False),
                ("attn_cos", self.min_attn_cos, True),
            ):
                value = row.get(key)
                if value is None and domain != "code" and key not in _PROSE_METRICS:
                    continue  # prose is scored on the next-token metrics alone
                interval = mean_interval(per[key]) if per.get(key) else None
                checks.append(Check(domain, f"{self.arm} {key}", value, bound, at_least, interval))
        copy_problems, copy_checks = self.copy_checks(evidence)
        done_problems, done_checks = self.completion_checks(evidence)
        return problems + copy_problems + done_problems, checks + copy_checks + done_checks

    def completion_failures(self, evidence: dict) -> list[str]:
        """The downstream gate alone (empty when the evidence has no completion task)."""
        problems, checks = self.completion_checks(evidence)
        return problems + [c.message() for c in checks if self.blocks(c)]

    def completion_checks(self, evidence: dict) -> tuple[list[str], list[Check]]:
        """The downstream bar: on the next-line task where the evidence has it (edit similarity), else on the
        completion task (exact lines); the served arm may fall at most ``max_completion_drop`` below full prefill."""
        if evidence.get("next_line"):
            return self._next_line_checks(evidence["next_line"])
        arms = (evidence.get("completion") or {}).get("arms")
        if not arms:
            return [], []
        full, got = arms.get("full"), arms.get(self.arm)
        if full is None or got is None:
            return [f"the completion task has no full or {self.arm!r} arm; re-run `kvferry eval`"], []
        per = evidence["completion"].get("per_task") or {}
        interval = difference_interval(per[self.arm], per["full"]) if per.get(self.arm) and per.get("full") else None
        note = (
            f"completion: {self.arm} writes {got:.3f} of the lines exactly, full prefill {full:.3f} (gate: within "
            f"{self.max_completion_drop:.2f}; truncation {arms.get('truncate', float('nan')):.3f})"
        )
        return [], [
            Check(
                "completion",
                f"{self.arm} exact lines minus full prefill's",
                got - full,
                -self.max_completion_drop,
                True,
                interval,
                note,
            )
        ]

    def _next_line_checks(self, ev: dict) -> tuple[list[str], list[Check]]:
        arms, per = ev.get("arms") or {}, ev.get("per_task") or {}
        if "full" not in arms or self.arm not in arms:
            return [f"the next-line task has no full or {self.arm!r} arm; re-run `kvferry eval`"], []
        full, got = arms["full"]["edit_sim"], arms[self.arm]["edit_sim"]
        interval = (
            difference_interval(per[self.arm]["edit_sim"], per["full"]["edit_sim"])
            if self.arm in per and "full" in per
            else None
        )
        truncate = arms.get("truncate", {}).get("edit_sim", float("nan"))
        note = (
            f"next line: {self.arm} edit similarity {got:.3f}, full prefill {full:.3f} (gate: within "
            f"{self.max_completion_drop:.2f}; truncation {truncate:.3f})"
        )
        return [], [
            Check(
                "next line",
                f"{self.arm} edit similarity minus full prefill's",
                got - full,
                -self.max_completion_drop,
                True,
                interval,
                note,
            )
        ]

    def copy_failures(self, evidence: dict) -> list[str]:
        """The long-range gate alone: reasons the copy-probe evidence fails (empty when it passes or is off)."""
        problems, checks = self.copy_checks(evidence)
        return problems + [c.message() for c in checks if self.blocks(c)]

    def copy_checks(self, evidence: dict) -> tuple[list[str], list[Check]]:
        """The long-range gate's checks: per domain and gap where the target copies, the share of its copy accuracy the
        arm keeps. The code domain's probe is required; a prose probe, where measured, is checked too."""
        if self.min_copy_retention <= 0:
            return [], []
        copy = evidence.get("copy")
        if not copy or not copy.get("gaps"):
            return ["the map has no long-range (copy probe) evidence; re-run `kvferry eval` on it"], []
        problems, checks = [], []
        for domain, ev in domains(evidence):
            where = "" if domain == "code" else f"{domain}: "
            for gap, row in sorted((ev.get("copy") or {}).get("gaps", {}).items(), key=lambda kv: int(kv[0])):
                full, got = row.get("full"), row.get(self.arm)
                if full is None or got is None:
                    problems.append(
                        f"{where}the copy probe at gap {gap} has no {self.arm!r} arm; re-run `kvferry eval`"
                    )
                    continue
                if full < self.min_copy_full:
                    continue  # the target shows no long-range skill here to lose
                per = row.get("per_prompt") or []
                interval = (
                    ratio_interval([p[self.arm] for p in per], [p["full"] for p in per])
                    if per and all(self.arm in p for p in per)
                    else None
                )
                note = (
                    f"{where}long-range copy at gap {gap}: {self.arm} {got:.3f} keeps {got / full:.0%} of full "
                    f"prefill's {full:.3f} (gate: >= {self.min_copy_retention:.0%}; truncation scores "
                    f"{row.get('truncate', float('nan')):.3f})"
                )
                checks.append(
                    Check(domain, f"copy kept at gap {gap}", got / full, self.min_copy_retention, True, interval, note)
                )
        return problems, checks

    def verdict(self, evidence: dict | None, force: bool = False) -> tuple[bool, list[str]]:
        """The one answer to "may this map serve?": (serves, the gate failures). ``force`` serves it anyway
        (testing)."""
        problems = self.failures(evidence)
        return (not problems or force), problems

    def check(self, ms: MapSet, force: bool = False) -> None:
        """Raise GateFailed for a map that may not serve, unless ``force``."""
        serves, problems = self.verdict(ms.evidence, force)
        if not serves:
            raise GateFailed(
                f"map {ms.name} {ms.version} is gated off: "
                + "; ".join(problems)
                + ". Improve the map, lower the gates deliberately, or force it for testing."
            )


_PROSE_METRICS = ("top10", "top1", "kl")


def domains(evidence: dict) -> list[tuple[str, dict]]:
    """The evidence's domains as (name, evidence of that domain): "code" (the top level), then "prose" if measured."""
    out = [("code", evidence)]
    if isinstance(evidence.get("prose"), dict):
        out.append(("prose", evidence["prose"]))
    return out


def load_for_serving(
    path, gates: Gates | None = None, force: bool = False, expect_source=None, expect_target=None
) -> MapSet:
    """Load and verify an artifact, then refuse it unless its evidence passes ``gates`` (or ``force``)."""
    from .artifact import load

    ms = load(path, expect_source, expect_target)
    (gates or Gates()).check(ms, force=force)
    return ms
