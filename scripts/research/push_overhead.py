"""What a StreamingApplier push costs beyond its arithmetic (issue 16, session 22): a map's pushes for chunks of a few
tokens, where the matmuls are small and the bookkeeping shows, then for the sizes a sidecar sees; one torch thread, as
a lane runs. Prints the best of ``--reps`` per case and a profile of the small case.

    .venv/bin/python scripts/research/push_overhead.py --map smollm2-135m-l25__smollm2-135m
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from kvferry import paths
from kvferry.mappings.apply import StreamingApplier
from kvferry.sidecar.registry import MapRegistry


def pushes(ms, n: int, chunk: int) -> tuple[float, int]:
    """Milliseconds to push ``n`` random tokens of every source layer in token ranges of ``chunk``, and the pushes."""
    g = ms.source.geometry
    app = StreamingApplier(ms, 0, torch.float32, n, 0)
    src = [(torch.randn(1, g.kv_heads, n, g.head_dim), torch.randn(1, g.kv_heads, n, g.head_dim)) for _ in range(g.layers)]
    count, t0 = 0, time.perf_counter()
    with torch.no_grad():
        for s in range(0, n, chunk):
            for layer, (k, v) in enumerate(src):
                for kind, t in (("k", k), ("v", v)):
                    list(app.push(layer, kind, t[:, :, s : s + chunk], s))
                    count += 1
    return (time.perf_counter() - t0) * 1e3, count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--map", default="smollm2-135m-l25__smollm2-135m")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    registry = MapRegistry(paths.maps_dir(), force=True)
    registry.scan()
    ms = registry.resolve(a.map, "")
    pushes(ms, 64, 16)  # warm-up
    print(f"map {ms.name} {ms.version}; best of {a.reps}\n\n| tokens | chunk | ms | pushes | ms per push |\n|---|---|---|---|---|")
    for n, chunk in ((64, 16), (64, 64), (2048, 2048), (2048, 1024), (2048, 512)):
        runs = [pushes(ms, n, chunk) for _ in range(a.reps)]
        best = min(t for t, _ in runs)
        print(f"| {n} | {chunk} | {best:.1f} | {runs[0][1]} | {best / runs[0][1]:.3f} |")
    profile = cProfile.Profile()
    profile.enable()
    calls = pushes(ms, 64, 16)
    profile.disable()
    print(f"\nprofile of 64 tokens in chunks of 16 ({calls[1]} pushes):")
    pstats.Stats(profile).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
