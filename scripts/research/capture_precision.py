"""The target's forward over one 1,024-token training window in float32 and under bf16 autocast: the time of each
and how far apart the tail's next-token distributions are (the numbers in data/refs/README.md behind
``kvferry distill --capture-precision bfloat16``).

    .venv/bin/python scripts/research/capture_precision.py --target qwen2.5-coder-1.5b --corpus runs/data/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvferry.mappings.lab.capture import load_model, read_corpus, token_windows
from kvferry.mappings.precision import autocast
from kvferry.pretrained import model_path


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--corpus", nargs="+", default=["runs/data/train.jsonl"])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=48)
    ap.add_argument("--out", type=Path, default=Path("runs/results/capture_precision.json"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    m = load_model(model_path(a.target))
    ids = token_windows(m.tokenizer, read_corpus(a.corpus), a.seq_len)[0][None]
    logits, seconds = {}, {}
    for precision in ("float32", "bfloat16"):
        for _ in range(2):  # the second run is timed: the first warms up kernels and autocast's weight casts
            t0 = time.perf_counter()
            with autocast(m.model, precision):
                logits[precision] = m.model(input_ids=ids).logits[0, -a.tail :].float()
            seconds[precision] = time.perf_counter() - t0
    p, q = logits["float32"].log_softmax(-1), logits["bfloat16"].log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    out = {
        "seconds": seconds,
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agree": float((p.argmax(-1) == q.argmax(-1)).float().mean()),
    }
    print(json.dumps(out, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
