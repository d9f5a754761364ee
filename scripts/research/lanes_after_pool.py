"""Issue 16, session 24: is `bench translate`'s lanes column (c) slowed by the pool's map run just before it? The bench
takes, each round and in one process, the map on torch's pool and then the same map in lanes; libgomp's workers spin
for a while after the pool's map, on the cores the lanes need. This times the lanes' map as the bench does (right after
the pool's), and after an idle pause, and the pool's map alone, in turn, on the tiny family's cache of a held-out
prompt:

    .venv/bin/python scripts/research/lanes_after_pool.py --sizes 2048 8192 --reps 15 --json runs/results/lanes_after_pool_s24.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvferry.bench.harness import long_ids, tiny_pair, write_json
from kvferry.mappings.apply import apply
from kvferry.mappings.capture import capture_kv
from kvferry.sidecar.compute import ComputeThread


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pause", type=float, default=0.1, help="seconds idle before the settled lanes' map")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    ms, source, target = tiny_pair()
    laned = ComputeThread(2)  # as the bench: a one-core feeding thread and two lanes
    rows = []
    for n in a.sizes:
        with torch.no_grad():
            src = capture_kv(source.model, long_ids(target.tokenizer, n)[:, : n - 16])

        def pool():
            with torch.no_grad():
                apply(ms, src, 0)

        def lanes():
            laned.submit(torch.no_grad()(apply), ms, src, 0, 0, laned.lanes).result()

        pool(), lanes()  # warm-up
        seen = {"pool": [], "lanes_after_pool": [], "lanes_settled": []}
        for _ in range(a.reps):
            for name, fn, pause in (("pool", pool, a.pause), ("lanes_after_pool", lanes, 0.0), ("lanes_settled", lanes, a.pause)):
                time.sleep(pause)
                t0 = time.perf_counter()
                fn()
                seen[name].append((time.perf_counter() - t0) * 1e3)
        row = {"n": n, **{f"{k}_ms": statistics.median(v) for k, v in seen.items()}, "times_ms": seen}
        rows.append(row)
        print(f"n={n}: pool {row['pool_ms']:.1f} ms | lanes right after the pool {row['lanes_after_pool_ms']:.1f} ms | "
              f"lanes after {a.pause} s idle {row['lanes_settled_ms']:.1f} ms (medians of {a.reps})", flush=True)
    laned.shutdown()
    if a.json:
        write_json(a.json, {"map": ms.name, "version": ms.version, "pause_s": a.pause, "rows": rows})


if __name__ == "__main__":
    main()
