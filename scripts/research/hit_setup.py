"""What the research scripts on the hit path share: the bench prefix store's secret and block size, their command
line (--sizes, --reps, --json, and any the script adds) and the tiny pair on two compute threads."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvferry.bench.harness import tiny_pair

SECRET, BS = b"bench-secret", 256


def hit_args(sizes=(272, 2048, 8192), reps: int = 41, more=None) -> argparse.Namespace:
    """The parsed command line; ``more(parser)`` adds a script's own options."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=list(sizes))
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--json", type=Path, default=None)
    if more is not None:
        more(ap)
    return ap.parse_args()


def bench_pair():
    """The tiny family's map, source and target (``tiny_pair``), with torch on the two threads the benches use."""
    torch.set_num_threads(2)
    return tiny_pair()
