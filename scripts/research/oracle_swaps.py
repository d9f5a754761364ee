"""Where does a map still lose? Put the target's own K or V into chosen layers of the mapped cache and measure.

Each arm is the map's cache with one group of (layer, K/V) replaced by the target's exact ones (its own prefill of
the same tokens). An arm that closes most of the gap to full prefill says where the map's remaining error matters;
one that does not says that group is already good enough. Copy probe (refresh 16) at each gap, and next-token
top-1 / top-10 / KL on held-out code prompts (mapped + refresh 16, against the target's full prefill), all on the
same fresh prompts (seed 11). Example:

    python scripts/research/oracle_swaps.py --map maps/smollm2-135m-l10__smollm2-135m/0.3.0 \
        --out runs/results/oracle_swaps
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
from kvferry.mappings.capture import capture_kv, load_model, read_corpus, to_dynamic_cache, token_stream
from kvferry.mappings.capture import token_windows
from kvferry.mappings.copy_probe import CopySettings, continuation_accuracy, make_examples

GROUPS = {  # arm name -> (layers, kinds) taken from the target
    "exact_K_10-24": (range(10, 25), "k"),
    "exact_V_10-24": (range(10, 25), "v"),
    "exact_KV_25-29": (range(25, 30), "kv"),
    "exact_V_10-29": (range(10, 30), "v"),
    "exact_K_10-14": (range(10, 15), "k"),
    "exact_K_15-19": (range(15, 20), "k"),
    "exact_K_20-24": (range(20, 25), "k"),
}


def swapped(mapped, gold, layers, kinds):
    out = list(mapped)
    for l in layers:
        k, v = mapped[l]
        out[l] = (gold[l][0] if "k" in kinds else k, gold[l][1] if "v" in kinds else v)
    return out


def arms_of(mapped, gold):
    out = {"mapped": mapped}
    for name, (layers, kinds) in GROUPS.items():
        out[name] = swapped(mapped, gold, layers, kinds)
    return out


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--map", type=Path, required=True)
    ap.add_argument("--gaps", default="500,1000,3000")
    ap.add_argument("--prompts", type=int, default=4, help="copy prompts per gap")
    ap.add_argument("--next-prompts", type=int, default=40, help="next-token code prompts")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", type=Path, default=Path("runs/results/oracle_swaps"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    ms = load(a.map)
    target = load_model(paths.model_dir("pretrained") / ms.target.name)
    source = load_model(paths.model_dir("pretrained") / ms.source.name, ms.source.name)
    r = 16
    t0 = time.perf_counter()
    sums: dict[tuple[str, str], float] = {}
    counts: dict[str, int] = {}

    def add(col: str, arm: str, v: float) -> None:
        sums[(col, arm)] = sums.get((col, arm), 0.0) + v

    texts = list(read_corpus([paths.data_file("heldout.jsonl")]))
    gaps = tuple(int(g) for g in a.gaps.split(","))
    for ex in make_examples(token_stream(target.tokenizer, texts), CopySettings(gaps=gaps, prompts=a.prompts, seed=a.seed)):
        n = len(ex.prompt)
        ids = torch.tensor([ex.prompt[: n - r]])
        mapped, gold = apply(ms, capture_kv(source.model, ids), 0), capture_kv(target.model, ids)
        col = f"copy_{ex.gap}"
        counts[col] = counts.get(col, 0) + 1
        add(col, "full", continuation_accuracy(target.model, None, ex.prompt, ex.answer))
        add(col, "truncate", continuation_accuracy(target.model, None, ex.prompt[n - r:], ex.answer))
        for arm, kv in arms_of(mapped, gold).items():
            add(col, arm, continuation_accuracy(target.model, kv, ex.prompt[n - r:], ex.answer))
    windows = token_windows(target.tokenizer, texts, 512)
    rng = random.Random(a.seed)
    for i in range(a.next_prompts):
        ids = windows[(i * 7 + 3) % len(windows)][: rng.randint(128, 512)][None]
        n = ids.shape[1]
        want = target.model(input_ids=ids).logits[0, -1].float().log_softmax(-1)
        pre = ids[:, : n - r]
        mapped, gold = apply(ms, capture_kv(source.model, pre), 0), capture_kv(target.model, pre)
        counts["next"] = counts.get("next", 0) + 1
        for arm, kv in [("truncate", None)] + list(arms_of(mapped, gold).items()):
            cache = to_dynamic_cache(kv, target.model.config) if kv is not None else None
            got = target.model(input_ids=ids[:, n - r:], past_key_values=cache).logits[0, -1].float().log_softmax(-1)
            add("top1", arm, float(got.argmax() == want.argmax()))
            add("top10", arm, len(set(got.topk(10).indices.tolist()) & set(want.topk(10).indices.tolist())) / 10)
            add("kl", arm, float((want.exp() * (want - got)).sum()))
    cols = [f"copy_{g}" for g in gaps] + ["top1", "top10", "kl"]
    arms = list(dict.fromkeys(arm for _, arm in sums))
    table = {arm: {c: sums[(c, arm)] / counts["next" if not c.startswith("copy") else c]
                   for c in cols if (c, arm) in sums} for arm in arms}
    result = {"map": str(a.map), "seed": a.seed, "copy_prompts": a.prompts, "next_prompts": a.next_prompts,
              "seconds": time.perf_counter() - t0, "arms": table}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| arm | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for arm in arms:
        lines.append(f"| {arm} | " + " | ".join(f"{table[arm][c]:.3f}" if c in table[arm] else "" for c in cols) + " |")
    (a.out.with_suffix(".md")).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"{result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
