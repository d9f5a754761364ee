"""Issue 16, the direct read's join: a key-only hit read from Redis by the client itself (``DirectReader.read``), with
the found blocks joined per layer in one numpy call (shipped) against the piece-by-piece join it replaced, and the raw
MGET of the same blobs, called in turn (round robin) in one process against a real redis-server.

    .venv/bin/python scripts/research/direct_join_ab.py --sizes 2048 8192 --reps 41 --json runs/results/direct_join_ab.json
"""

from __future__ import annotations

import statistics

import torch

from hit_setup import BS, SECRET, bench_pair, hit_args  # scripts/research/hit_setup.py (beside this script)
from kvferry import paths
from kvferry.bench.harness import RedisServer, ServerProcess, published_prefix, round_robin_ms, write_json
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.client.direct import DirectReader
from kvferry.common.prefix import map_id, map_namespaces, model_id
from kvferry.common.prefix_cache import Lookup, PrefixCache
from kvferry.common.stores import RedisStore
from kvferry.sidecar.servicer import mapping_info
from kvferry.sidecar.registry import MapRegistry


def main() -> None:
    a = hit_args(sizes=(2048, 8192), reps=41)
    ms, source, target = bench_pair()
    registry = MapRegistry(paths.maps_dir(), force=True)
    registry.scan()
    info = next(mapping_info(e, "mapped_refresh") for e in registry.entries(ms.name) if e.maps.version == ms.version)
    redis_server, results = RedisServer(), {}
    one_call = Lookup.layers
    piece_by_piece = lambda look: look._join_pieces()  # noqa: E731 - the join before (for blocks in the stored dtype)
    try:
        store = RedisStore(redis_server.url)
        reader = DirectReader(store, SECRET, BS)
        with ServerProcess(paths.maps_dir(), redis_url=redis_server.url, prefix_secret=SECRET.decode(), prefix_block_size=BS) as sc, \
                TranslateClient(ClientOptions(target=sc.address, timeout=300)) as client:
            for n in a.sizes:
                prefix, key, kw = published_prefix(source, target, ms, store, SECRET, n, BS)
                client.translate(None, ms.name, ms.version, **kw)  # the miss: the sidecar maps and stores the target blocks
                _, tgt_ns = map_namespaces("bench", model_id(ms.source), model_id(ms.target), map_id(ms.name, ms.version, ms.content_sha256))
                keys = [tgt_ns.key(h) for h in PrefixCache(None, SECRET, BS).hashes(tgt_ns, prefix)]

                def read(join):
                    def call():
                        Lookup.layers = join
                        try:
                            hit = reader.read(info, prefix, key, "bench")
                        finally:
                            Lookup.layers = one_call
                        assert hit is not None and hit.stats.cached_blocks == len(keys)
                        return hit
                    return call

                calls = {"one_call": read(one_call), "piece_by_piece": read(piece_by_piece), "raw_get": lambda: store.get_many(keys)}
                want, got = calls["piece_by_piece"]().layers, calls["one_call"]().layers
                assert all(torch.equal(x, y) for pw, pg in zip(want, got) for x, y in zip(pw, pg))
                times = round_robin_ms(calls, a.reps)
                med = {v: statistics.median(t) for v, t in times.items()}
                results[n] = {"median_ms": med, "min_ms": {v: min(t) for v, t in times.items()}, "reps": a.reps,
                              "direct_vs_get": {v: med["raw_get"] / med[v] for v in ("one_call", "piece_by_piece")}}
                print(f"n={n}: " + " | ".join(f"{v} {m:.2f}" for v, m in med.items()) + f" ms (medians of {a.reps}, round robin); "
                      f"GET/direct {med['raw_get'] / med['one_call']:.2f} (one call) vs {med['raw_get'] / med['piece_by_piece']:.2f}",
                      flush=True)
    finally:
        redis_server.stop()
    write_json(a.json, results)


if __name__ == "__main__":
    main()
