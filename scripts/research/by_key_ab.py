"""Issue 16, the hit path's per-call cost: a key-only hit through TranslateByKey (one request message, unary-stream)
against the same hit through Translate (header as a second message, stream-stream), on one sidecar process with
every target block stored, called in turn (round robin); the gRPC floor of the same message sizes in the same rounds.

    .venv/bin/python scripts/research/by_key_ab.py --sizes 272 2048 8192 --reps 41 --json runs/results/by_key_ab.json
"""

from __future__ import annotations

import statistics

import torch

from hit_setup import BS, SECRET, bench_pair, hit_args  # scripts/research/hit_setup.py (beside this script)
from kvferry import paths
from kvferry.bench.harness import RedisServer, ServerProcess, published_prefix, round_robin_ms, write_json
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.common.stores import RedisStore


def main() -> None:
    a = hit_args(reps=41)
    ms, source, target = bench_pair()
    redis_server, results = RedisServer(), {}
    server = ServerProcess(paths.maps_dir(), redis_url=redis_server.url, prefix_secret=SECRET.decode(), prefix_block_size=BS)
    try:
        by_key = TranslateClient(ClientOptions(target=server.address, timeout=300))
        stream = TranslateClient(ClientOptions(target=server.address, timeout=300))
        stream.endpoints.has_by_key = [False]  # as a client does after a sidecar without TranslateByKey answered
        store = RedisStore(redis_server.url)
        for n in a.sizes:
            prefix, _, kw = published_prefix(source, target, ms, store, SECRET, n, BS)
            first = by_key.translate(None, ms.name, ms.version, **kw)  # the miss: maps and stores; then all hit
            calls = {"TranslateByKey": lambda: by_key.translate(None, ms.name, ms.version, **kw),
                     "Translate": lambda: stream.translate(None, ms.name, ms.version, **kw),
                     "floor": lambda: server.replay([2 * b.key.numel() * b.key.element_size() for b in first.blocks])}
            hits = [calls[v]() for v in ("TranslateByKey", "Translate")]
            assert all(h.stats.cached_blocks == len(prefix) // BS for h in hits)
            assert all(torch.equal(x.key, y.key) and torch.equal(x.value, y.value) for x, y in zip(hits[0].blocks, hits[1].blocks))
            times = round_robin_ms(calls, a.reps)
            med = {v: statistics.median(t) for v, t in times.items()}
            results[n] = {"median_ms": med, "min_ms": {v: min(t) for v, t in times.items()}, "reps": a.reps}
            print(f"n={n}: " + " | ".join(f"{v} {m:.2f}" for v, m in med.items()) + f" ms (medians of {a.reps}, round robin); "
                  f"TranslateByKey / Translate {med['TranslateByKey'] / med['Translate']:.3f}", flush=True)
        by_key.close()
        stream.close()
    finally:
        server.close()
        redis_server.stop()
    write_json(a.json, results)


if __name__ == "__main__":
    main()
