"""Measured evidence for a map: how close the target's behaviour from a mapped cache is to gold.

Arms, all scored against the target's own full prefill (gold) at the next-token position:
  no_context      the target sees only the last token
  truncate        the target recomputes only the last r tokens (no earlier cache)
  mapped          the mapped cache for all but the last token; the target computes the last token
  mapped_refresh  the mapped cache for all but the last r tokens; the target recomputes those r
  mapped_sinks    like mapped, with the first s tokens' KV exact (the target computes them)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from ..apply import apply
from ..artifact import MapSet
from ..cache import LayerKV, cache_layers, kv_join, kv_slice, to_dynamic_cache
from ..drift import Drift, QueryTap, tail_drift
from ..errors import InvalidInput
from ..features import to_features
from .capture import LoadedModel, capture_kv, read_corpus, token_windows
from .completion import CompletionSettings, completion_task
from .copy_probe import CopySettings, copy_probe
from .memo import Memo
from .next_line import NextLineSettings, library_files, next_line_task
from .recall import make_probe, probe_fillers

ARMS = ("gold", "no_context", "truncate", "mapped", "mapped_refresh", "mapped_sinks")


@dataclass
class EvalSettings:
    """What ``kvferry eval`` measures and on how much data."""

    prompts: int = 100
    """Held-out prompts for next-token metrics."""
    min_len: int = 128
    """Shortest prompt, in tokens."""
    max_len: int = 512
    """Longest prompt, in tokens (keep within the models' trained length)."""
    refresh: int = 16
    """r: tokens the target recomputes in the truncate and mapped_refresh arms."""
    sinks: int = 4
    """s: leading tokens kept exact in the mapped_sinks arm."""
    positions: int = 1
    """Positions scored per prompt: the prompt's next token, then (teacher-forced) the text's next ``positions - 1``,
    each arm computing them on top of its own cache, so every scored position lies past the refresh window. The
    scores average over a prompt's positions; intervals still resample prompts."""
    greedy_prompts: int = 16
    """Prompts on which 32-token greedy continuations are compared."""
    greedy_tokens: int = 32
    """Length of those greedy continuations."""
    recall_prompts: int = 50
    """Long-range recall probe prompts (0 to skip)."""
    copy: CopySettings | None = field(default_factory=CopySettings)
    """The long-range copy probe the serving gate reads (None skips it, and the gate then refuses the map)."""
    prose_prompts: int = 0
    """Held-out prose prompts for next-token metrics beside code (needs ``prose`` texts; 0 skips). With prose, the
    copy probe runs on it too, and the gate reads the worse of the two domains."""
    completion: CompletionSettings | None = None
    """The downstream task on the held-out code (:mod:`completion`; None skips it)."""
    next_line: NextLineSettings | None = None
    """The long-context downstream task (:mod:`next_line`, on the files of ``data/next_line_files.json``; None skips
    it). Where measured, the gate's downstream bar reads it."""
    seed: int = 0
    """Seed for prompt sampling."""

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.min_len < 2 or self.max_len < self.min_len:
            raise InvalidInput("need prompts >= 1 and 2 <= min_len <= max_len")
        if not 1 <= self.refresh < self.min_len:
            raise InvalidInput(f"refresh must be in [1, min_len); got {self.refresh}")
        if not 0 <= self.sinks < self.min_len - 1:
            raise InvalidInput("sinks must be smaller than min_len - 1")
        if self.prose_prompts < 0:
            raise InvalidInput("prose_prompts must be >= 0")
        if not 1 <= self.positions <= 256:
            raise InvalidInput(f"positions must be in [1, 256], got {self.positions}")


class _AttnTap:
    """Captures each attention block's output at the last position."""

    def __init__(self, model):
        self.out: list[torch.Tensor] = []
        layers = model.model.layers
        self.handles = [l.self_attn.register_forward_hook(self._hook) for l in layers]

    def _hook(self, module, args, output):
        o = output[0] if isinstance(output, tuple) else output
        self.out.append(o[0, -1].detach().float())

    def take(self) -> torch.Tensor:
        out, self.out = torch.stack(self.out), []
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class NextTokenScores:
    """Running next-token agreement of an arm with the full prefill: top-1, top-10 overlap (shared tokens counted as
    integers, so a mean that is exactly a threshold reads as it), KL(full || arm) and attention-output cosine. Each
    prompt's top-1, top-10 and KL are kept too (``per_prompt`` in the result), for the gate's intervals."""

    def __init__(self):
        self.n = 0
        self.top1 = self.kl = self.cos = 0.0
        self.top10 = Fraction(
            0
        )  # shared tokens, counted exactly: a mean of tenths summed in floats drifts (48/60 read 0.79999…)
        self.per_prompt: dict[str, list[float]] = {"top1": [], "top10": [], "kl": []}

    def add(self, gold: torch.Tensor, logits: torch.Tensor, attn_gold=None, attn=None) -> None:
        """One prompt: ``gold`` and ``logits`` are [vocab] (its next token) or [positions, vocab] (several,
        averaged)."""
        gold, logits = gold.reshape(-1, gold.shape[-1]), logits.reshape(-1, logits.shape[-1])
        p = gold.shape[0]
        lp_g, lp = gold.log_softmax(-1), logits.log_softmax(-1)
        self.n += 1
        top1 = float((gold.argmax(-1) == logits.argmax(-1)).float().mean())
        shared = sum(
            len(set(a.tolist()) & set(b.tolist())) for a, b in zip(gold.topk(10).indices, logits.topk(10).indices)
        )
        kl = float((lp_g.exp() * (lp_g - lp)).sum(-1).mean())
        self.top1 += top1
        self.top10 += Fraction(shared, p)
        self.kl += kl
        for key, value in (("top1", top1), ("top10", shared / (10 * p)), ("kl", round(kl, 6))):
            self.per_prompt[key].append(value)
        if attn is not None:
            self.cos += float(torch.nn.functional.cosine_similarity(attn_gold, attn, dim=-1).mean())

    def result(self, with_cos: bool) -> dict:
        n = max(self.n, 1)
        out = {
            "top1": self.top1 / n,
            "top10": float(self.top10 / (10 * n)),
            "kl": self.kl / n,
            "per_prompt": {k: list(v) for k, v in self.per_prompt.items()},
        }
        if with_cos:
            out["attn_cos"] = self.cos / n
        return out


class _LayerError:
    """Per target layer and K/V: relative error and R² of mapped vs true position-free features."""

    def __init__(self, layers: int):
        self.acc = {(l, k): [0.0, 0.0, None, 0] for l in range(layers) for k in "kv"}  # sse, sum y², sum y, n

    def add(self, mapped: list[LayerKV], true: list[LayerKV], ms: MapSet, pos: torch.Tensor) -> None:
        spec = ms.target.geometry.rope
        for l, ((mk, mv), (tk, tv)) in enumerate(zip(mapped, true)):
            for kind, m, t in (("k", mk, tk), ("v", mv, tv)):
                sp = spec if kind == "k" else None
                fm, ft = to_features(m, sp, pos)[0].double(), to_features(t, sp, pos)[0].double()
                a = self.acc[(l, kind)]
                a[0] += float(((fm - ft) ** 2).sum())
                a[1] += float((ft**2).sum())
                a[2] = ft.sum(0) if a[2] is None else a[2] + ft.sum(0)
                a[3] += ft.shape[0]

    def result(self) -> list[dict]:
        out = []
        for (l, kind), (sse, yy, sy, n) in sorted(self.acc.items()):
            sst = yy - float((sy**2).sum()) / n
            out.append({"layer": l, "kind": kind, "rel_err": (sse / yy) ** 0.5, "r2": 1 - sse / sst})
        return out


@torch.no_grad()
def greedy_continuation(model, ids: torch.Tensor, kv: list[LayerKV] | None, tokens: int, pad: int) -> list[int]:
    """Greedy continuation of ``ids``; with ``kv`` the target reuses it for the first positions."""
    cache = to_dynamic_cache(kv, model.config) if kv is not None else None
    out = model.generate(ids, past_key_values=cache, max_new_tokens=tokens, do_sample=False, pad_token_id=pad)
    return out[0, ids.shape[1] :].tolist()


def _agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


@torch.no_grad()
def _arm_caches(ms: MapSet, source: LoadedModel, target: LoadedModel, ids: torch.Tensor, s: EvalSettings):
    """Per arm: (kv to reuse or None, ids the target still computes)."""
    n = ids.shape[1]
    r = s.refresh
    gold = capture_kv(target.model, ids[:, : n - 1])
    mapped = apply(ms, capture_kv(source.model, ids[:, : n - 1]), 0)
    return (
        gold,
        mapped,
        {
            "gold": (gold, ids[:, n - 1 :]),
            "no_context": (None, ids[:, n - 1 :]),
            "truncate": (None, ids[:, n - r :]),
            "mapped": (mapped, ids[:, n - 1 :]),
            "mapped_refresh": (kv_slice(mapped, 0, n - r), ids[:, n - r :]),
            "mapped_sinks": (kv_join(kv_slice(gold, 0, s.sinks), kv_slice(mapped, s.sinks, n - 1)), ids[:, n - 1 :]),
        },
    )


@torch.no_grad()
def evaluate(
    ms: MapSet,
    source: LoadedModel,
    target: LoadedModel,
    heldout: list[str],
    settings: EvalSettings | None = None,
    progress: bool = True,
    prose: list[str] | None = None,
    memo: Memo | None = None,
) -> dict:
    """Run every arm on held-out text, the recall and copy probes (and prose, if given); returns the evidence dict.
    ``memo`` keeps the target's own arms of the copy probe and the completion task across evaluations of the pair."""
    s = settings or EvalSettings()
    from ..artifact import check_identity

    check_identity(source.identity, ms.source, "source")
    check_identity(target.identity, ms.target, "target")
    texts = list(read_corpus(heldout))
    cuts = _prompts(target, texts, s, s.prompts, s.seed)
    prompts = [ids for ids, _ in cuts]
    scores = {arm: NextTokenScores() for arm in ARMS if arm != "gold"}
    layer_err = _LayerError(ms.target.geometry.layers)
    greedy = {arm: [] for arm in ("truncate", "mapped", "mapped_refresh", "mapped_sinks")}
    tap = _AttnTap(target.model)
    qtap = QueryTap(target.model, ms.target.geometry.rope)
    drifts: list[Drift] = []
    iterator = prompts
    if progress:
        from tqdm import tqdm

        iterator = tqdm(prompts, desc="eval", unit="prompt")
    try:
        for pi, ids in enumerate(iterator):
            gold_kv, mapped, arms = _arm_caches(ms, source, target, ids, s)
            tap.out.clear()
            layer_err.add(mapped, gold_kv, ms, torch.arange(ids.shape[1] - 1))
            logits, attn = {}, {}
            for arm, (kv, tail) in arms.items():
                cache = to_dynamic_cache(kv, target.model.config) if kv is not None else None
                logits[arm] = _scored(target, kv, tail, cuts[pi][1], s.positions, cache)
                attn[arm] = tap.take()
                if arm == "mapped_refresh" and s.refresh > 1:  # the free drift signal, as the client measures it live
                    n = ids.shape[1]
                    queries = qtap.queries(range(n - s.refresh, n + s.positions - 1))
                    drifts.append(
                        tail_drift(
                            kv_slice(mapped, n - s.refresh, n - 1),
                            kv_slice(cache_layers(cache), n - s.refresh, n - 1),
                            [q[:, : s.refresh - 1] for q in queries],
                        )
                    )
            for arm, sc in scores.items():
                sc.add(logits["gold"], logits[arm], attn["gold"], attn[arm])
            if pi < s.greedy_prompts:
                pad = target.tokenizer.pad_token_id
                ref = greedy_continuation(target.model, ids, None, s.greedy_tokens, pad)
                tap.out.clear()
                for arm in greedy:
                    kv, tail = arms[arm]
                    if kv is None:
                        got = greedy_continuation(target.model, tail, None, s.greedy_tokens, pad)
                    else:
                        got = greedy_continuation(target.model, ids, kv, s.greedy_tokens, pad)
                    greedy[arm].append(_agreement(ref, got))
                    tap.out.clear()
    finally:
        tap.close()
        qtap.close()
    arms_out = {arm: sc.result(arm not in ("no_context", "truncate")) for arm, sc in scores.items()}
    if drifts:
        arms_out["mapped_refresh"]["drift_attn_cos"] = sum(d.mean_attn_cos for d in drifts) / len(drifts)
        arms_out["mapped_refresh"]["drift_rel_err"] = sum(d.mean_rel_err for d in drifts) / len(drifts)
    for arm in arms_out:
        if greedy.get(arm):
            arms_out[arm]["greedy_agree"] = sum(greedy[arm]) / len(greedy[arm])
    if s.recall_prompts:
        for arm, acc in recall_accuracy(ms, source, target, texts, s).items():
            arms_out.setdefault(arm, {})["recall"] = acc
    settings = {k: getattr(s, k) for k in s.__dataclass_fields__ if k not in ("copy", "completion", "next_line")}
    out = {"settings": settings, "arms": arms_out, "layers": layer_err.result(), "recommended_refresh": s.refresh}
    if s.copy is not None:
        out["copy"] = copy_probe(ms, source, target, texts, s.copy, progress, memo)
    if prose and s.prose_prompts:
        prose_texts = list(read_corpus(prose))
        out["prose"] = {"arms": next_token_arms(ms, source, target, prose_texts, s, s.prose_prompts)}
        if s.copy is not None:
            out["prose"]["copy"] = copy_probe(ms, source, target, prose_texts, s.copy, progress, memo)
    if s.completion is not None:
        out["completion"] = completion_task(ms, source, target, texts, s.completion, progress, memo)
    if s.next_line is not None:
        from kvferry import paths

        files = library_files(paths.data_file("next_line_files.json"))
        out["next_line"] = next_line_task(ms, source, target, files, s.next_line, progress, memo)
    return out


@torch.no_grad()
def next_token_arms(
    ms: MapSet, source: LoadedModel, target: LoadedModel, texts: list[str], s: EvalSettings, prompts: int
) -> dict:
    """Next-token top-1 / top-10 / KL of each arm against full prefill, on ``prompts`` prompts cut from ``texts``."""
    scores = {arm: NextTokenScores() for arm in ARMS if arm != "gold"}
    for ids, extra in _prompts(target, texts, s, prompts, s.seed + 1):
        _, _, arms = _arm_caches(ms, source, target, ids, s)
        logits = {}
        for arm, (kv, tail) in arms.items():
            logits[arm] = _scored(target, kv, tail, extra, s.positions)
        for arm, sc in scores.items():
            sc.add(logits["gold"], logits[arm])
    return {arm: sc.result(False) for arm, sc in scores.items()}


def _prompts(target: LoadedModel, texts: list[str], s: EvalSettings, count: int, seed: int):
    """``count`` (prompt [1, L], the text's next ``positions - 1`` tokens [1, positions - 1]) pairs: L drawn in
    [min_len, max_len] by a generator seeded with ``seed``, from windows of the held-out ``texts``."""
    windows = token_windows(target.tokenizer, texts, s.max_len + s.positions - 1)
    if not windows:
        raise InvalidInput(f"held-out text is shorter than one {s.max_len + s.positions - 1}-token prompt")
    rng = random.Random(seed)
    out = []
    for i in range(count):
        w, n = windows[i % len(windows)], rng.randint(s.min_len, s.max_len)
        out.append((w[:n][None], w[n : n + s.positions - 1][None]))
    return out


def _scored(
    target: LoadedModel, kv, tail: torch.Tensor, extra: torch.Tensor, positions: int, cache=None
) -> torch.Tensor:
    """An arm's logits [positions, vocab] at the prompt's last position and the ``extra`` tokens after it, the target
    computing ``tail`` + ``extra`` on top of ``kv`` (``cache``: that cache made already)."""
    if cache is None and kv is not None:
        cache = to_dynamic_cache(kv, target.model.config)
    ids = torch.cat([tail, extra], 1) if extra.numel() else tail
    return target.model(input_ids=ids, past_key_values=cache).logits[0, -positions:].float()


@torch.no_grad()
def recall_accuracy(ms: MapSet, source: LoadedModel, target: LoadedModel, texts: list[str], s: EvalSettings) -> dict:
    """Exact-match accuracy of the recall probe under each arm (answers > 64 tokens back)."""
    tok = target.tokenizer
    probe = make_probe(probe_fillers(texts, tok, count=s.recall_prompts), count=s.recall_prompts)
    hits = {arm: 0 for arm in ARMS}
    hits["truncate_64"] = 0
    pad = tok.pad_token_id
    for ex in probe:
        ids = tok(ex.prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        _, _, arms = _arm_caches(ms, source, target, ids, s)
        arms["truncate_64"] = (None, ids[:, -64:])
        for arm, (kv, tail) in arms.items():
            if arm == "gold":
                gen = greedy_continuation(target.model, ids, None, 6, pad)
            elif kv is None:
                gen = greedy_continuation(target.model, tail, None, 6, pad)
            else:
                gen = greedy_continuation(target.model, ids, kv, 6, pad)
            hits[arm] += tok.decode(gen).split('"')[0] == ex.answer
    return {arm: h / len(probe) for arm, h in hits.items()}


def format_table(evidence: dict, title: str = "") -> str:
    """A plain-text table of the arms, for the terminal and README."""
    cols = ("top1", "top10", "kl", "attn_cos", "greedy_agree", "recall")
    lines = [title] if title else []
    lines.append(f"| {'arm':<16} | " + " | ".join(f"{c:>12}" for c in cols) + " |")
    lines.append("|" + "-" * 18 + "|" + "|".join("-" * 14 for _ in cols) + "|")
    for arm in ("no_context", "truncate", "truncate_64", "mapped", "mapped_refresh", "mapped_sinks", "gold"):
        row = evidence["arms"].get(arm)
        if row is None:
            continue
        cells = [f"{row[c]:>12.3f}" if c in row else f"{'':>12}" for c in cols]
        lines.append(f"| {arm:<16} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
