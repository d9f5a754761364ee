"""Issue 16, sessions 20-21: a whole l25-sized map, pushed layer by layer, three ways: on torch's two-thread pool
("pool"); in two token lanes fed by a one-core thread, as the sidecar maps since session 21 ("lanes",
sidecar/lanes.py); and each of two single-threaded threads mapping its own half of the tokens through every layer with
no thread feeding them ("halves": the bound of the lanes). On an idle machine and beside a process that keeps part of
a core busy (a stand-in for the transfer threads that share the cores with the map). Session 20 measured a fourth
mode, each step cut into token slices on two threads (mappings/split.py, removed in session 21): run this script at
commit 55d4cb8 for it.

Each case runs in a fresh process (OpenMP state is per process) and maps the same random source cache through the
StreamingApplier layer by layer, as the sidecar does; the busy process copies 8 MiB buffers for ``duty`` of every 10 ms.
Cases alternate (pool, lanes, halves, pool, ...) so the machine's drift hits both alike.

    .venv/bin/python scripts/research/split_contention.py --map maps/smollm2-135m-l25__smollm2-135m/0.2.0 \\
        --tokens 2048 --duties 0 0.5 0.8 --rounds 2 --reps 9 --json runs/results/split_contention_s21.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CASE = r"""
import json, statistics, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
from kvferry.mappings.apply import StreamingApplier
from kvferry.mappings.artifact import load
from kvferry.sidecar.lanes import Lanes, one_torch_thread
path, n, mode, reps, duty = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
ms = load(path)
g = ms.source.geometry
torch.manual_seed(0)
src = [(torch.randn(1, g.kv_heads, n, g.head_dim), torch.randn(1, g.kv_heads, n, g.head_dim)) for _ in range(g.layers)]
one_core = mode != "pool"
thread = ThreadPoolExecutor(1, initializer=one_torch_thread if one_core else None)  # the sidecar's compute thread
lanes = Lanes(2) if mode == "lanes" else None
other = ThreadPoolExecutor(1, initializer=one_torch_thread)

def tokens(a, b):
    app = lanes.applier(ms, a, torch.bfloat16, b - a, 0) if lanes else StreamingApplier(ms, a, torch.bfloat16, b - a)
    with torch.no_grad():
        for layer, (k, v) in enumerate(src):
            for kind, t in (("k", k), ("v", v)):
                for _ in app.push(layer, kind, t[:, :, a:b]):
                    pass
        for _ in app.drain():
            pass

def run():
    if mode != "halves":
        return tokens(0, n)
    rest = other.submit(tokens, n // 2, n)
    tokens(0, n // 2)
    rest.result()

busy = None
if duty > 0:
    busy = subprocess.Popen([sys.executable, "-c", f'''
import time
buf = bytearray(64 << 20)
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < {duty} * 0.01:
        bytes(buf[: 8 << 20])
    time.sleep((1 - {duty}) * 0.01)
'''])
    time.sleep(0.5)
try:
    thread.submit(run).result(), thread.submit(run).result()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        thread.submit(run).result()
        ts.append((time.perf_counter() - t0) * 1e3)
finally:
    if busy is not None:
        busy.kill()
print(json.dumps(ts))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--map", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--duties", type=float, nargs="+", default=[0.0, 0.5, 0.8])
    ap.add_argument("--rounds", type=int, default=2, help="fresh processes per case, alternating")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    results = []
    for duty in a.duties:
        times: dict[str, list[float]] = {"pool": [], "lanes": [], "halves": []}
        for _ in range(a.rounds):
            for mode in times:
                out = subprocess.run([sys.executable, "-c", CASE, str(a.map), str(a.tokens), mode, str(a.reps), str(duty)],
                                     capture_output=True, text=True, check=True)
                times[mode] += json.loads(out.stdout.strip().splitlines()[-1])
        row = {"duty": duty, **{f"{m}_median_ms": statistics.median(t) for m, t in times.items()}, "times_ms": times}
        results.append(row)
        print(f"busy {duty:.1f} core: torch pool {row['pool_median_ms']:.1f} ms | lanes {row['lanes_median_ms']:.1f} ms | "
              f"halves {row['halves_median_ms']:.1f} ms (medians of {len(times['pool'])})", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"map": str(a.map), "tokens": a.tokens, "rows": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
