"""What solving maps costs as models get wider: measured kernels, counted work, an estimate per geometry.

Greedy selection (k source layers per target map, by held-out R²) costs, per fit:
  D eigendecompositions of a candidate set's centred Gram (d = j * w_in for j = 1..k), shared across maps
  E held-out path evaluations (map x candidate), each three d x d x dy products
where w_in is one source layer's K+V width and dy one target map's width. This script times those two
kernels at the widths of a few real geometries on this machine and multiplies them by the counts, taking
D from the measured SmolLM2 fit (274 decompositions for 10 source layers, k = 4) scaled by the number of
candidate sets, and E = maps * sum_j (L_s - j + 1). The estimate is an estimate: the counts for
the real pair were measured (``kvferry fit`` prints them), the kernels are timed here.

    python scripts/research/fit_scaling.py --json runs/results/fit_scaling.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

# name: (source layers, source kv width per K or V, target layers, target kv width per K or V)
GEOMETRIES = {
    "tiny S->T (shipped)": (4, 64, 6, 96),
    "SmolLM2-135M l10 -> 30": (10, 192, 30, 192),
    "Llama-3.2-1B -> 3B": (16, 512, 28, 1024),
}
K = 4
MEASURED_DECOMPOSITIONS = 274  # kvferry fit, smollm2-135m-l10 -> smollm2-135m, k = 4 (docs/real_pair.md)


def _time(fn, reps: int = 2) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def kernels(d: int, dy: int) -> tuple[float, float]:
    a = torch.randn(2 * d, d, dtype=torch.float64)
    c = a.T @ a
    y = torch.randn(d, dy, dtype=torch.float64)
    t_eig = _time(lambda: torch.linalg.eigh(c), reps=1 if d > 2048 else 2)
    t_eval = _time(lambda: (c @ y, c @ y, (c @ y) @ (c @ y).T)) * 3 / 4  # three d x d x dy products
    return t_eig, t_eval


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    base_sets = sum(math.comb(10, j) for j in range(1, K + 1))
    for name, (ls, ws, lt, wt) in GEOMETRIES.items():
        w_in, dy, maps = 2 * ws, wt, 2 * lt
        sets = sum(math.comb(ls, j) for j in range(1, K + 1))
        d_count = min(sets, MEASURED_DECOMPOSITIONS * sets / base_sets)
        evals = maps * sum(ls - j + 1 for j in range(1, min(K, ls) + 1))
        t_total = 0.0
        detail = []
        for j in range(1, min(K, ls) + 1):
            d = j * w_in
            t_eig, t_eval = kernels(d, dy)
            share = math.comb(ls, j) / sets
            t_total += d_count * share * t_eig + maps * (ls - j + 1) * t_eval
            detail.append({"d": d, "eigh_s": t_eig, "eval_s": t_eval})
        rows.append(
            {
                "geometry": name,
                "source_layers": ls,
                "input_width_per_layer": w_in,
                "target_maps": maps,
                "dy": dy,
                "decompositions_est": round(d_count),
                "evaluations": evals,
                "solve_minutes_est": t_total / 60,
                "kernels": detail,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| geometry | source layers | d per layer (K+V) | maps | decompositions | path evaluations | est. solve (2 "
        "cores) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['geometry']} | {r['source_layers']} | {r['input_width_per_layer']} | {r['target_maps']} | "
            f"~{r['decompositions_est']} | {r['evaluations']} | {r['solve_minutes_est']:.1f} min |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
