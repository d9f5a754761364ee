"""Issue 16: why the sidecar's map ran slower than the same map in-process, shown without gRPC.

Each case runs in a fresh process (OpenMP state is per process): load a map and a random source cache, then time
`apply` on one thread. Cases:
  main             everything on the main thread (how `kvferry bench translate` times (c))
  worker           everything on one worker thread (the sidecar's compute thread, when nothing else touches torch)
  worker+main_copy the same, after the main thread has run one torch copy of a million floats: a second thread
                   has then entered a parallel region, as the sidecar's map loading (an asyncio.to_thread worker)
                   and its event loop (casting cached blocks) did before session 11
Printed beside each: the process's voluntary context switches during the timed applies (the compute thread's pool
sleeping on futexes between parallel regions shows up there).

    .venv/bin/python scripts/research/thread_apply.py maps/S__T/1.1.0 --tokens 2048 --json runs/results/thread_apply.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CASE = r"""
import json, resource, statistics, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
from kvferry.mappings.apply import apply
from kvferry.mappings.artifact import load
case, path, tokens, reps, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
if case == "worker+main_copy":
    torch.empty(10**6).copy_(torch.ones(10**6))
def work():
    ms = load(path)
    g = ms.source.geometry
    src = [tuple(torch.randn(1, g.kv_heads, tokens, g.head_dim) for _ in range(2)) for _ in range(g.layers)]
    apply(ms, src, 0)
    r0, ts = resource.getrusage(resource.RUSAGE_SELF), []
    for _ in range(reps):
        t = time.perf_counter()
        apply(ms, src, 0)
        ts.append((time.perf_counter() - t) * 1e3)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "voluntary_switches": r1.ru_nvcsw - r0.ru_nvcsw}
out = work() if case == "main" else ThreadPoolExecutor(1).submit(work).result()
print(json.dumps(out))
"""
CASES = ("main", "worker", "worker+main_copy")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("map", type=Path)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2, help="each case runs this many times, in turn")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rows = []
    for r in range(a.rounds):
        for case in CASES:
            out = subprocess.run([sys.executable, "-c", CASE, case, str(a.map), str(a.tokens), str(a.reps), str(a.threads)],
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            rows.append({"round": r, "case": case} | json.loads(out))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nmap {a.map}; n = {a.tokens}; torch threads {a.threads}; medians of {a.reps} applies per process\n")
    print("| round | case | apply median ms | min ms | voluntary context switches |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['round']} | {row['case']} | {row['median_ms']:.1f} | {row['min_ms']:.1f} | {row['voluntary_switches']} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"map": str(a.map), "tokens": a.tokens, "threads": a.threads, "reps": a.reps,
                                      "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
