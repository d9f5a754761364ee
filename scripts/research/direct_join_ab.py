"""Issue 16, the direct read's join: a key-only hit read from Redis by the client itself (``DirectReader.read``) three
ways, and the raw MGET of the same blobs, called in turn (round robin) in one process against a real redis-server:

  views           shipped (session 18): a block per stored block and layer, viewing the fetched bytes, nothing joined
                  (an importer copies each block once, into its cache)
  one_call        the found blocks joined per layer in one numpy call (shipped in sessions 15-17)
  piece_by_piece  the join piece by piece (before session 15)

    .venv/bin/python scripts/research/direct_join_ab.py --sizes 2048 8192 --reps 41 --json runs/results/direct_join_ab.json
"""

from __future__ import annotations

import statistics

import torch

from hit_setup import BS, SECRET, bench_pair, hit_args  # scripts/research/hit_setup.py (beside this script)
from kvferry import paths
from kvferry.bench.harness import (RedisServer, ServerProcess, paired_ratio, published_prefix, round_robin_ms, spread,
                                   write_json)
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.client import direct
from kvferry.client.direct import DirectReader
from kvferry.common.messages import Block
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
    views = direct._hit_blocks
    joined = lambda layers: [Block(i, 0, layers[0][0].shape[2], 0, k[0], v[0]) for i, (k, v) in enumerate(layers)]  # noqa: E731
    joins = {"views": views, "one_call": lambda look: joined(Lookup.layers(look)),
             "piece_by_piece": lambda look: joined(look._join_pieces())}
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
                        direct._hit_blocks = join
                        try:
                            hit = reader.read(info, prefix, key, "bench")
                        finally:
                            direct._hit_blocks = views
                        assert hit is not None and hit.stats.cached_blocks == len(keys)
                        return hit
                    return call

                calls = {v: read(join) for v, join in joins.items()} | {"raw_get": lambda: store.get_many(keys)}
                want = calls["piece_by_piece"]().layers()
                for v in ("views", "one_call"):
                    assert all(torch.equal(x, y) for pw, pg in zip(want, calls[v]().layers()) for x, y in zip(pw, pg))
                times = round_robin_ms(calls, a.reps)
                med = {v: statistics.median(t) for v, t in times.items()}
                results[n] = {"median_ms": med, "min_ms": {v: min(t) for v, t in times.items()}, "reps": a.reps,
                              "direct_vs_get": {v: med["raw_get"] / med[v] for v in joins},
                              "direct_vs_get_paired": {v: paired_ratio(times, ("raw_get",), (v,)) for v in joins}}
                print(f"n={n}: " + " | ".join(f"{v} {m:.2f}" for v, m in med.items()) + f" ms (medians of {a.reps}, round robin); "
                      "GET/direct per round " + ", ".join(f"{v} {spread(results[n]['direct_vs_get_paired'][v])}" for v in joins),
                      flush=True)
    finally:
        redis_server.stop()
    write_json(a.json, results)


if __name__ == "__main__":
    main()
