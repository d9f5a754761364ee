"""Levers side by side on the same prompts: several maps of one pair, and oracle arms that put the target's own K/V
into chosen layers of one map's cache (which layers lose what; a "hybrid" that computes its first L layers itself).

Every arm is scored against the target's full prefill on the same prompts: the unguessable copy probe (code and
prose, refresh r) and next-token top-1 / top-10 / KL (mapped + refresh r). The target's own copy arms come from
--memo when it has them. Example (the Qwen2.5-Coder pair):

    python scripts/research/pair_levers.py --maps runs/maps/P/0.1.0 runs/maps/P/0.2.0 --oracle runs/maps/P/0.1.0 \
        --gaps 500,1000,3000 --prompts 4 --next-prompts 20 --memo runs/memo/qwen.jsonl --out runs/results/levers
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from kvferry import paths
from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import load
from kvferry.mappings.cache import to_dynamic_cache
from kvferry.mappings.lab.capture import capture_kv, load_model, read_corpus, token_windows
from kvferry.mappings.lab.copy_probe import CopySettings, continuation_accuracy, examples_for
from kvferry.mappings.lab.memo import Memo, Pin, remembered

DOMAINS = {"code": "heldout.jsonl", "prose": "prose_heldout.jsonl"}


def oracle_arms(mapped, gold, layers: int, hybrid: list[int]) -> dict:
    """name -> cache: the map's cache with some (layer, K/V) taken from the target's own prefill."""

    def swap(which):  # which(l) -> kinds taken from gold at layer l
        return [
            (gold[l][0] if "k" in which(l) else k, gold[l][1] if "v" in which(l) else v)
            for l, (k, v) in enumerate(mapped)
        ]

    out = {f"hybrid_L{L}": swap(lambda l, L=L: "kv" if l < L else "") for L in hybrid}
    out["exact_K"] = swap(lambda l: "k")
    out["exact_V"] = swap(lambda l: "v")
    quarter = -(-layers // 4)
    for q in range(4):
        lo, hi = q * quarter, min(layers, (q + 1) * quarter)
        out[f"mapped_only_{lo}-{hi - 1}"] = swap(lambda l, lo=lo, hi=hi: "" if lo <= l < hi else "kv")
    return out


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--maps", type=Path, nargs="+", required=True)
    ap.add_argument("--oracle", type=Path, default=None, help="the map whose cache the oracle arms edit")
    ap.add_argument("--hybrid", default="1,2,4,8", help="oracle: target layers computed by the target itself")
    ap.add_argument("--gaps", default="500,1000,3000")
    ap.add_argument("--prompts", type=int, default=4, help="copy prompts per gap and domain")
    ap.add_argument("--next-prompts", type=int, default=20, help="next-token prompts per domain")
    ap.add_argument("--domains", default="code,prose")
    ap.add_argument("--refresh", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memo", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("runs/results/levers"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    maps = {f"{p.parent.name}/{p.name}": load(p) for p in a.maps}
    first = next(iter(maps.values()))
    root = paths.model_dir("pretrained")
    target, source = load_model(root / first.target.name), load_model(root / first.source.name)
    oracle = load(a.oracle) if a.oracle else None
    hybrid = [int(x) for x in a.hybrid.split(",") if x]
    memo = Memo(a.memo, Pin.of(target, "float32")) if a.memo else None
    r, t0 = a.refresh, time.perf_counter()
    sums: dict[tuple[str, str], float] = {}
    counts: dict[str, int] = {}

    def add(col: str, arm: str, v: float) -> None:
        sums[(col, arm)] = sums.get((col, arm), 0.0) + v

    def mapped_arms(skv, gold):
        out = {name: apply(ms, skv, 0) for name, ms in maps.items()}
        if oracle is not None:
            out |= oracle_arms(apply(oracle, skv, 0), gold, target.identity.geometry.layers, hybrid)
        return out

    gaps = tuple(int(g) for g in a.gaps.split(","))
    who = (target.identity.weights, target.identity.geometry.fingerprint)
    cs = CopySettings(gaps=gaps, prompts=a.prompts, refresh=r, seed=a.seed)
    for domain in a.domains.split(","):
        texts = list(read_corpus([paths.data_file(DOMAINS[domain])]))
        for ex in examples_for(target.tokenizer, texts, cs):
            n, col = len(ex.prompt), f"{domain}_copy_{ex.gap}"
            counts[col] = counts.get(col, 0) + 1
            add(
                col,
                "truncate",
                remembered(
                    memo,
                    ("copy-truncate", *who, r, ex.prompt, ex.answer),
                    lambda: continuation_accuracy(target.model, None, ex.prompt[n - r :], ex.answer),
                ),
            )
            pre = torch.tensor([ex.prompt[: n - r]])
            gold = capture_kv(target.model, pre) if oracle is not None else None
            if gold is not None:  # full prefill, as its cache of the prefix and the tail on it (one prefill, not two)
                add(col, "full", continuation_accuracy(target.model, gold, ex.prompt[n - r :], ex.answer))
            else:
                add(
                    col,
                    "full",
                    remembered(
                        memo,
                        ("copy-full", *who, ex.prompt, ex.answer),
                        lambda: continuation_accuracy(target.model, None, ex.prompt, ex.answer),
                    ),
                )
            for arm, kv in mapped_arms(capture_kv(source.model, pre), gold).items():
                add(col, arm, continuation_accuracy(target.model, kv, ex.prompt[n - r :], ex.answer))
            print(col, {arm: round(sums[(col, arm)] / counts[col], 3) for c, arm in sums if c == col}, flush=True)
        windows = token_windows(target.tokenizer, texts, 384)
        rng = random.Random(a.seed)
        for i in range(a.next_prompts):
            ids = windows[(i * 7 + 3) % len(windows)][: rng.randint(128, 384)][None]
            n, col = ids.shape[1], f"{domain}_next"
            counts[col] = counts.get(col, 0) + 1
            pre = ids[:, : n - r]
            gold = capture_kv(target.model, pre) if oracle is not None else None
            if gold is not None:
                cache = to_dynamic_cache(gold, target.model.config)
                want = target.model(input_ids=ids[:, n - r :], past_key_values=cache, logits_to_keep=1).logits[0, -1]
            else:
                want = target.model(input_ids=ids, logits_to_keep=1).logits[0, -1]
            want = want.float().log_softmax(-1)
            for arm, kv in [("truncate", None), *list(mapped_arms(capture_kv(source.model, pre), gold).items())]:
                cache = to_dynamic_cache(kv, target.model.config) if kv is not None else None
                got = target.model(input_ids=ids[:, n - r :], past_key_values=cache, logits_to_keep=1).logits[0, -1]
                got = got.float().log_softmax(-1)
                add(f"{domain}_top1", arm, float(got.argmax() == want.argmax()))
                add(
                    f"{domain}_top10",
                    arm,
                    len(set(got.topk(10).indices.tolist()) & set(want.topk(10).indices.tolist())) / 10,
                )
                add(f"{domain}_kl", arm, float((want.exp() * (want - got)).sum()))
            counts[f"{domain}_top1"] = counts[f"{domain}_top10"] = counts[f"{domain}_kl"] = counts[col]
    cols = [c for c in dict.fromkeys(c for c, _ in sums)]
    arms = list(dict.fromkeys(arm for _, arm in sums))
    table = {arm: {c: sums[(c, arm)] / counts[c] for c in cols if (c, arm) in sums} for arm in arms}
    result = {
        "maps": [str(p) for p in a.maps],
        "oracle": str(a.oracle) if a.oracle else None,
        "seed": a.seed,
        "copy_prompts": a.prompts,
        "next_prompts": a.next_prompts,
        "refresh": r,
        "seconds": time.perf_counter() - t0,
        "arms": table,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| arm | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for arm in arms:
        lines.append(f"| {arm} | " + " | ".join(f"{table[arm][c]:.3f}" if c in table[arm] else "" for c in cols) + " |")
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"{result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
