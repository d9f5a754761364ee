"""Long-range copy probe: does the target still use a distant passage when its prefix cache is mapped?

Each prompt is a passage of held-out text, then ``gap`` tokens of other held-out text, then the passage's
first ``cue`` tokens again. By default the passage is made unguessable first (:mod:`scramble`: its names become
made-up words), so that only the passage itself predicts its continuation: a model that knows the kind of text
would otherwise continue it from the last few tokens alone, and truncation would look nearly as good as the map. A
model that uses its context continues the passage (in-context repetition,
the induction mechanism real models recall with); one that cannot see the passage guesses. The score is
teacher-forced next-token accuracy on the passage's next ``score`` tokens.

Arms (the same compute as the next-token arms in :mod:`evaluate`):
  full            the target's own prefill of the whole prompt
  truncate        the target sees only the prompt's last r tokens
  mapped          the mapped cache for all but the prompt's last token
  mapped_refresh  the mapped cache for all but the last r tokens; the target recomputes those r
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..apply import apply
from ..artifact import MapSet
from ..cache import LayerKV, kv_slice, to_dynamic_cache
from ..errors import InvalidInput
from .capture import LoadedModel, capture_kv, token_stream
from .memo import Memo, remembered
from .scramble import scramble

COPY_ARMS = ("full", "truncate", "mapped", "mapped_refresh")


@dataclass(frozen=True)
class CopySettings:
    """Shape and size of the copy probe."""

    gaps: tuple[int, ...] = (500, 1000, 3000)
    """Tokens of other text between the passage and its repetition."""
    prompts: int = 12
    """Prompts per gap (one prompt is 1/12 of a gap's accuracy)."""
    passage: int = 120
    """Passage length in tokens."""
    cue: int = 40
    """Leading passage tokens repeated at the end of the prompt."""
    score: int = 40
    """Passage tokens after the cue whose next-token accuracy is scored."""
    refresh: int = 16
    """r: tokens the target recomputes in the truncate and mapped_refresh arms: the cue, then the gap's last
    ``r - cue`` tokens when r exceeds the cue. At most ``cue + min(gaps)``, so the passage is read only from the
    mapped cache."""
    seed: int = 0
    """Seed for choosing passages and gaps."""
    unguessable: bool = True
    """Passages are scrambled (:func:`scramble.scramble`, seeded by ``seed``); the gaps stay plain text."""

    def __post_init__(self) -> None:
        if not self.gaps or any(g < 1 for g in self.gaps):
            raise InvalidInput("copy probe gaps must be positive token counts")
        if self.prompts < 1:
            raise InvalidInput("copy probe needs at least one prompt per gap")
        if not 1 <= self.cue < self.passage or not 1 <= self.score <= self.passage - self.cue:
            raise InvalidInput("copy probe needs 1 <= cue < passage and 1 <= score <= passage - cue")
        most = self.cue + min(self.gaps)
        if not 1 <= self.refresh <= most:
            raise InvalidInput(
                f"copy probe refresh must be in [1, cue + smallest gap = {most}] so that the passage stays in the"
                f" mapped cache; got {self.refresh} (lower --refresh or raise the smallest --copy-gaps)"
            )

    @classmethod
    def from_dict(cls, d: dict) -> CopySettings:
        """The settings recorded in evidence (evidence without ``unguessable`` was measured on plain passages)."""
        return cls(
            **{k: (tuple(v) if k == "gaps" else v) for k, v in d.items()} | {"unguessable": d.get("unguessable", False)}
        )

    def as_dict(self) -> dict:
        return {
            "gaps": list(self.gaps),
            "prompts": self.prompts,
            "passage": self.passage,
            "cue": self.cue,
            "score": self.score,
            "refresh": self.refresh,
            "seed": self.seed,
            "unguessable": self.unguessable,
        }


@dataclass(frozen=True)
class CopyExample:
    """``prompt`` ends with the passage's first tokens; ``answer`` is what follows them in the passage."""

    prompt: list[int]
    answer: list[int]
    gap: int


def make_examples(stream: list[int], s: CopySettings, passages: list[int] | None = None) -> list[CopyExample]:
    """Passages and gaps drawn from disjoint stretches of ``stream``; with ``passages`` (another token stream, such
    as the same text scrambled) the passages come from it and the gaps from ``stream``."""
    need = s.passage + max(s.gaps)
    pool = stream if passages is None else passages
    if len(stream) < need + s.passage or len(pool) < 2 * s.passage:
        raise InvalidInput(
            f"the copy probe needs at least {need + s.passage} tokens of held-out text "
            f"(gap {max(s.gaps)} + passages of {s.passage}); got {len(stream)}. Add text or lower the gaps."
        )
    rng = random.Random(s.seed)
    out = []
    for gap in s.gaps:
        for _ in range(s.prompts):
            while True:
                p0 = rng.randrange(0, len(pool) - s.passage)
                g0 = rng.randrange(0, len(stream) - gap)
                if passages is not None or g0 + gap <= p0 or g0 >= p0 + s.passage:
                    break
            passage = pool[p0 : p0 + s.passage]
            out.append(
                CopyExample(passage + stream[g0 : g0 + gap] + passage[: s.cue], passage[s.cue : s.cue + s.score], gap)
            )
    return out


def examples_for(tokenizer, texts, s: CopySettings) -> list[CopyExample]:
    """The probe's prompts from held-out ``texts`` (scrambled passages when ``s.unguessable``)."""
    texts = list(texts)
    stream = token_stream(tokenizer, texts)
    passages = token_stream(tokenizer, [scramble(t, s.seed) for t in texts]) if s.unguessable else None
    return make_examples(stream, s, passages)


@torch.no_grad()
def continuation_accuracy(model, prefix: list[LayerKV] | None, tail: list[int], answer: list[int]) -> float:
    """Teacher-forced accuracy on ``answer`` when the model computes ``tail`` + answer[:-1] after ``prefix``."""
    ids = torch.tensor([tail + answer[:-1]])
    cache = to_dynamic_cache(prefix, model.config) if prefix is not None else None
    logits = model(input_ids=ids, past_key_values=cache).logits[0, -len(answer) :]
    return float((logits.argmax(-1) == torch.tensor(answer)).float().mean())


@torch.no_grad()
def score_example(
    ex: CopyExample, target: LoadedModel, r: int, mapped: list[LayerKV] | None = None, memo: Memo | None = None
) -> dict:
    """Each arm's accuracy on one example; ``mapped`` is the mapped cache of ``prompt[:-1]`` (None: no mapped arms).
    The target's own arms come from ``memo`` when it has them."""
    n = len(ex.prompt)
    who = (target.identity.weights, target.identity.geometry.fingerprint)
    out = {
        "full": remembered(
            memo,
            ("copy-full", *who, ex.prompt, ex.answer),
            lambda: continuation_accuracy(target.model, None, ex.prompt, ex.answer),
        ),
        "truncate": remembered(
            memo,
            ("copy-truncate", *who, r, ex.prompt, ex.answer),
            lambda: continuation_accuracy(target.model, None, ex.prompt[n - r :], ex.answer),
        ),
    }
    if mapped is not None:
        out["mapped"] = continuation_accuracy(target.model, mapped, ex.prompt[n - 1 :], ex.answer)
        out["mapped_refresh"] = continuation_accuracy(
            target.model, kv_slice(mapped, 0, n - r), ex.prompt[n - r :], ex.answer
        )
    return out


@torch.no_grad()
def copy_probe(
    ms: MapSet,
    source: LoadedModel,
    target: LoadedModel,
    texts,
    settings: CopySettings | None = None,
    progress: bool = False,
    memo: Memo | None = None,
) -> dict:
    """The probe's evidence: per gap, each arm's mean accuracy and the mapped arms' retention of ``full``."""
    s = settings or CopySettings()
    examples = examples_for(target.tokenizer, texts, s)
    per: dict[int, list[dict]] = {g: [] for g in s.gaps}
    iterator = examples
    if progress:
        from tqdm import tqdm

        iterator = tqdm(examples, desc="copy probe", unit="prompt")
    for ex in iterator:
        ids = torch.tensor([ex.prompt[:-1]])
        mapped = apply(ms, capture_kv(source.model, ids), 0)
        per[ex.gap].append(score_example(ex, target, s.refresh, mapped, memo))
    gaps = {}
    for g in s.gaps:
        row = {arm: sum(p[arm] for p in per[g]) / len(per[g]) for arm in COPY_ARMS}
        full = row["full"]
        row["retention"] = row["mapped_refresh"] / full if full > 0 else None
        row["prompts"] = len(per[g])
        row["per_prompt"] = [{arm: round(p[arm], 6) for arm in COPY_ARMS} for p in per[g]]  # in make_examples' order
        gaps[str(g)] = row
    return {"settings": s.as_dict(), "gaps": gaps}


def format_copy_table(copy: dict, title: str = "") -> str:
    """Plain-text table of the probe: one row per gap."""
    lines = [title] if title else []
    r = copy["settings"]["refresh"]
    lines.append(f"| gap | full prefill | truncate to {r} | mapped | mapped + refresh {r} | retention | prompts |")
    lines.append("|---|---|---|---|---|---|---|")
    for g, row in sorted(copy["gaps"].items(), key=lambda kv: int(kv[0])):
        ret = "n/a" if row.get("retention") is None else f"{row['retention']:.3f}"
        lines.append(
            f"| {g} | {row['full']:.3f} | {row['truncate']:.3f} | {row['mapped']:.3f} | "
            f"{row['mapped_refresh']:.3f} | {ret} | {row['prompts']} |"
        )
    return "\n".join(lines)
