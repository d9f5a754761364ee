"""In-process apply time of several map versions, side by side (interleaved repetitions, medians).

    .venv/bin/python scripts/research/apply_time.py maps/smollm2-135m-l10__smollm2-135m/0.1.0 \\
        runs/maps/smollm2-135m-l10__smollm2-135m/0.2.0 --tokens 2048 8192 --reps 5 --out runs/results/apply_time

Source KV is random (the arithmetic does not depend on the values); the maps run in their stored dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import load


def random_cache(g, n: int) -> list:
    """A source cache of ``n`` tokens in geometry ``g`` (one per set: maps of one run may read different sources)."""
    return [tuple(torch.randn(1, g.kv_heads, n, g.head_dim) for _ in range(2)) for _ in range(g.layers)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("maps", nargs="+", type=Path)
    ap.add_argument("--tokens", nargs="+", type=int, default=[2048, 8192])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("runs/results/apply_time"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    sets = [load(p) for p in a.maps]
    rows = []
    for n in a.tokens:
        kvs = [random_cache(ms.source.geometry, n) for ms in sets]
        times: dict[int, list[float]] = {i: [] for i in range(len(sets))}
        for i, ms in enumerate(sets):
            apply(ms, kvs[i])  # warm-up
        for _ in range(a.reps):
            for i, ms in enumerate(sets):
                t0 = time.perf_counter()
                apply(ms, kvs[i])
                times[i].append((time.perf_counter() - t0) * 1e3)
        for i, ms in enumerate(sets):
            weights = sum(m.weight.numel() for m in ms.maps.values())
            rows.append({"map": str(a.maps[i]), "tokens": n, "weights": weights, "median_ms": statistics.median(times[i]),
                         "runs_ms": times[i]})
    table = ["| map | tokens | weights | apply ms (median) |", "|---|---|---|---|"]
    table += [f"| {r['map']} | {r['tokens']} | {r['weights'] / 1e6:.1f} M | {r['median_ms']:.1f} |" for r in rows]
    print("\n".join(table))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps({"settings": {k: str(v) for k, v in vars(a).items()}, "rows": rows}, indent=1))
    a.out.with_suffix(".md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
