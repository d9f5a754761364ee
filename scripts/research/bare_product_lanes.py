"""Issue 16, session 27: does torch's pool, spinning after its own product, slow the single-threaded lanes that run
right after it? A bare 2,048 x 512 x 1,152 float32 product (the tiny map's fused group) on the pool (two threads),
then split into two halves on two lanes (one torch thread each, as sidecar/lanes.py runs them) right after the
pool's, after 10 ms and 0.2 s idle, and after the lanes' own. Medians of ``--reps``, printed:

    .venv/bin/python scripts/research/bare_product_lanes.py --reps 11
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvferry.sidecar.lanes import one_torch_thread, started, torch_threads_kept


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=11)
    a = ap.parse_args()
    torch.set_num_threads(2)
    x, w, b = torch.randn(a.tokens, 512), torch.randn(512, 1152), torch.randn(1152)
    with torch_threads_kept():
        lanes = [started(ThreadPoolExecutor(1, initializer=one_torch_thread)) for _ in range(2)]
    halves = [x[: a.tokens // 2], x[a.tokens // 2 :]]

    def on_lanes() -> None:
        for f in [lanes[i].submit(torch.addmm, b, halves[i], w) for i in range(2)]:
            f.result()

    def pool() -> None:
        torch.addmm(b, x, w)

    before = {"pool": (pool, 0.0), "pool, 10 ms idle": (pool, 0.01), "pool, 0.2 s idle": (pool, 0.2), "lanes": (on_lanes, 0.0)}
    times: dict[str, list[float]] = {"pool alone": [], **{f"lanes after {k}": [] for k in before}}
    pool(), on_lanes()  # warm-up
    for _ in range(a.reps):
        time.sleep(0.2)
        t0 = time.perf_counter()
        pool()
        times["pool alone"].append(time.perf_counter() - t0)
        for name, (first, idle) in before.items():
            first()
            time.sleep(idle)
            t0 = time.perf_counter()
            on_lanes()
            times[f"lanes after {name}"].append(time.perf_counter() - t0)
    for name, ts in times.items():
        print(f"{name}: {statistics.median(ts) * 1e3:.1f} ms")
    for lane in lanes:
        lane.shutdown()


if __name__ == "__main__":
    main()
