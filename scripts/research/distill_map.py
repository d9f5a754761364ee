"""A map set distilled through the frozen target (kvferry.mappings.lab.distill), scored side by side.

``kvferry distill`` is the product command; this script runs the same distillation and then the copy probe on
fresh held-out prompts, with the starting map and the distilled one side by side (the target recomputes the last
16 tokens in both): full, truncate_16, base, distilled.

Training text: the calibration split (``--train calib``; its last tenth held out) or the corpus's train split
(``--train train``: the standard-library files data/corpus.json lists there, read from this Python's stdlib; the
calibration split is then the held-out set).

    cd scripts/research && ../../.venv/bin/python distill_map.py --map ../../runs/maps/<pair>/<version> \\
        --train train --tokens 163840 --tails 2 --epochs 3 --save-version 0.2.3 --out ../../runs/results/distill_map

``--skip-windows N`` continues on text an earlier run did not see (the train split's windows after its first N).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from tables import write_results  # scripts/research/tables.py (beside this script)
from window_keys import heldout_examples, load_pair

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from write_split import split_texts

from kvferry import paths
from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import save
from kvferry.mappings.cache import kv_slice
from kvferry.mappings.lab.capture import capture_kv, read_corpus, token_windows
from kvferry.mappings.lab.copy_probe import continuation_accuracy
from kvferry.mappings.lab.distill import DistillSettings, capture_tails, distill


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--map", type=Path, required=True)
    ap.add_argument("--train", choices=["calib", "train"], default="calib")
    ap.add_argument("--tokens", type=int, default=100000, help="training tokens (at most)")
    ap.add_argument("--held-windows", type=int, default=12, help="held-out windows when --train train")
    ap.add_argument(
        "--skip-windows",
        type=int,
        default=0,
        help="leave out the train split's first windows (text an earlier run trained on)",
    )
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--from-layer", type=int, default=10, help="train the maps of this target layer and above")
    ap.add_argument("--tail", type=int, default=48)
    ap.add_argument("--tails", type=int, default=1)
    ap.add_argument("--repeat-span", type=int, default=160)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--temperature", type=float, default=1.0, help="the training loss's KL temperature")
    ap.add_argument("--gaps", default="500,1000")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--save-version", default="")
    ap.add_argument("--save-to", type=Path, default=Path("runs/maps"))
    ap.add_argument("--out", type=Path, default=Path("runs/results/distill_map"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    t_start = time.perf_counter()
    ms, source, target = load_pair(a.map)
    s = DistillSettings(
        from_layer=a.from_layer,
        tail=a.tail,
        tails=a.tails,
        repeat_span=a.repeat_span,
        epochs=a.epochs,
        lr=a.lr,
        seed=a.seed,
        temperature=a.temperature,
    )
    calib = token_windows(target.tokenizer, read_corpus([paths.data_file("calib.jsonl")]), a.seq)
    if a.train == "calib":
        windows = calib[: a.tokens // a.seq]
        held = max(1, len(windows) // 10)
        train_w, held_w = windows[:-held], windows[-held:]
    else:
        skip = a.skip_windows * a.seq
        train_w = token_windows(target.tokenizer, split_texts("train"), a.seq, a.tokens + skip)[a.skip_windows :]
        held_w = calib[: a.held_windows]
    rng = random.Random(a.seed)
    train, heldout = (
        capture_tails(ms, source, target, train_w, s, rng),
        capture_tails(ms, source, target, held_w, s, rng),
    )
    print(
        f"captured {len(train_w)} + {len(held_w)} held-out windows of {a.seq} tokens, {a.tails} tail(s) each, "
        f"in {time.perf_counter() - t_start:.0f} s",
        flush=True,
    )
    maps, log = distill(ms, source, target, train, heldout, s, progress=lambda line: print(line, flush=True))
    del train, heldout
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    if a.save_version:
        record = s.as_dict() | {
            "seq_len": a.seq,
            "train": a.train,
            "train_windows": len(train_w),
            "held_windows": len(held_w),
            "log": log,
            "script": "scripts/research/distill_map.py",
        }
        print(f"wrote {save(maps.mapset(a.save_version, record), a.save_to)}", flush=True)

    r = 16
    sums: dict[tuple[int, str], float] = {}
    with torch.no_grad():
        for ex in heldout_examples(target, a.gaps, a.prompts, a.seed):
            n = len(ex.prompt)
            ids = torch.tensor([ex.prompt[:-1]])
            skv = capture_kv(source.model, ids)
            base = [(k.float(), v.float()) for k, v in apply(ms, skv, 0)]
            row = {
                "full": continuation_accuracy(target.model, None, ex.prompt, ex.answer),
                "truncate_16": continuation_accuracy(target.model, None, ex.prompt[n - r :], ex.answer),
            }
            for name, kv in (("base", base), ("distilled", maps.cache(skv, base, n - 1))):
                row[name] = continuation_accuracy(target.model, kv_slice(kv, 0, n - r), ex.prompt[n - r :], ex.answer)
            for k, v in row.items():
                sums[(ex.gap, k)] = sums.get((ex.gap, k), 0.0) + v
            print(ex.gap, {k: round(v, 3) for k, v in row.items()}, flush=True)
    gaps = sorted({g for g, _ in sums})
    arms = list(dict.fromkeys(k for _, k in sums))
    result = {
        "settings": settings,
        "seconds": time.perf_counter() - t_start,
        "training": log,
        "gaps": {str(g): {k: sums[(g, k)] / a.prompts for k in arms} for g in gaps},
    }
    write_results(a.out, result, gaps, arms)


if __name__ == "__main__":
    main()
