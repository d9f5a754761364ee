"""Side-by-side copy-probe measurement of levers for keeping long-range copying through a mapped cache.

Every arm runs on the same held-out prompts (seeded), against the same target:
  full                   the target's own prefill
  truncate_r             the target sees only the last r tokens
  <map>:refresh_r        the map's prefix, the target recomputes the last r tokens   (r in --refresh)
  <map>:sinks_s+refresh  the same with the first s tokens' KV exact (the target computes them: s tokens of work)

Writes JSON and a markdown table (``--out``). Example:
    python scripts/research/copy_levers.py --maps maps/smollm2-135m-l10__smollm2-135m/0.1.0 \
        maps/smollm2-135m-l25__smollm2-135m/0.1.0 --gaps 1000 --prompts 5 --out runs/results/copy_levers
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvferry import paths
from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import load
from kvferry.mappings.capture import capture_kv, kv_join, kv_slice, load_model, read_corpus
from kvferry.mappings.capture import token_stream
from kvferry.mappings.copy_probe import CopySettings, continuation_accuracy, make_examples


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--maps", nargs="+", type=Path, required=True)
    ap.add_argument("--target", type=Path, default=paths.model_dir("pretrained") / "smollm2-135m")
    ap.add_argument("--gaps", default="1000")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--refresh", default="16,64,256")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--seed", type=int, default=11, help="differs from the evidence's seed: these prompts are fresh")
    ap.add_argument("--out", type=Path, default=Path("runs/results/copy_levers"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    rs = [int(r) for r in a.refresh.split(",")]
    gaps = tuple(int(g) for g in a.gaps.split(","))
    target = load_model(a.target)
    stream = token_stream(target.tokenizer, read_corpus([paths.data_file("heldout.jsonl")]))
    s = CopySettings(gaps=gaps, prompts=a.prompts, seed=a.seed, refresh=16)
    exs = make_examples(stream, s)
    maps = []
    for m in a.maps:
        ms = load(m)
        folder = paths.model_dir("pretrained") / ms.source.name
        maps.append((ms, load_model(folder, ms.source.name)))
    sums: dict[tuple[int, str], float] = {}
    t0 = time.perf_counter()
    for ex in exs:
        n = len(ex.prompt)
        row = {"full": continuation_accuracy(target.model, None, ex.prompt, ex.answer)}
        for r in rs:
            row[f"truncate_{r}"] = continuation_accuracy(target.model, None, ex.prompt[n - r:], ex.answer)
        gold = capture_kv(target.model, torch.tensor([ex.prompt[: a.sinks]]))
        for ms, source in maps:
            mapped = apply(ms, capture_kv(source.model, torch.tensor([ex.prompt[:-1]])), 0)
            tag = ms.source.name
            for r in rs:
                row[f"{tag}:refresh_{r}"] = continuation_accuracy(target.model, kv_slice(mapped, 0, n - r), ex.prompt[n - r:], ex.answer)
            sinked = kv_join(gold, kv_slice(mapped, a.sinks, n - 16))
            row[f"{tag}:sinks_{a.sinks}+refresh_16"] = continuation_accuracy(target.model, sinked, ex.prompt[n - 16:], ex.answer)
        for k, v in row.items():
            sums[(ex.gap, k)] = sums.get((ex.gap, k), 0.0) + v
    arms = list(dict.fromkeys(k for _, k in sums))
    result = {"settings": {**s.as_dict(), "refresh": rs, "sinks": a.sinks, "maps": [str(m) for m in a.maps]},
              "seconds": time.perf_counter() - t0,
              "gaps": {str(g): {k: sums[(g, k)] / a.prompts for k in arms} for g in gaps}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| arm | " + " | ".join(f"gap {g}" for g in gaps) + " | share of full |", "|---|" + "---|" * (len(gaps) + 1)]
    for k in arms:
        vals = [result["gaps"][str(g)][k] for g in gaps]
        share = sum(vals) / max(sum(result["gaps"][str(g)]["full"] for g in gaps), 1e-9)
        lines.append(f"| {k} | " + " | ".join(f"{v:.3f}" for v in vals) + f" | {share:.2f} |")
    table = "\n".join(lines)
    a.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
