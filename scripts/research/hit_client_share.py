"""Issue 16, session 15: what a key-only hit costs beyond the gRPC floor with the store read taken out. Against a sidecar
whose MGET is answered from memory (hit_ab.py's no_get variant), called in turn (round robin), medians:

  client     TranslateClient.translate: the spec and its header built, the call, every message decoded in place
  bare       the same TranslateByKey call with the request serialised beforehand and the answer's bytes only counted
  floor      the gRPC floor: the block messages' sizes streamed from memory (hit_ab.py's floor)
  floor+2    the floor with two small messages more (the hit's response header and trailer)

client - bare is the client's share, bare - floor+2 the sidecar's (hashes, blob checks, session, joins, writes).

    .venv/bin/python scripts/research/hit_client_share.py --sizes 272 2048 8192 --reps 41 --json runs/results/hit_client_share.json
"""

from __future__ import annotations

import statistics

from hit_ab import VARIANTS  # scripts/research/hit_ab.py (beside this script)
from hit_setup import BS, SECRET, bench_pair, hit_args  # scripts/research/hit_setup.py (beside this script)
from kvferry import paths
from kvferry.bench.harness import RedisServer, ServerProcess, published_prefix, round_robin_ms, write_json
from kvferry.client.client import BY_KEY_METHOD, ClientOptions, TranslateClient, make_spec
from kvferry.common import wire
from kvferry.common.stores import RedisStore
from kvferry.v1 import translate_pb2 as pb


def main() -> None:
    a = hit_args(reps=41)
    ms, source, target = bench_pair()
    redis_server, results = RedisServer(), {}
    try:
        with ServerProcess(paths.maps_dir(), code=VARIANTS["no_get"], redis_url=redis_server.url, prefix_secret=SECRET.decode(),
                           prefix_block_size=BS) as sc, TranslateClient(ClientOptions(target=sc.address, timeout=300)) as client:
            bare = sc.channel.unary_stream(BY_KEY_METHOD)
            for n in a.sizes:
                _, _, kw = published_prefix(source, target, ms, RedisStore(redis_server.url), SECRET, n, BS)
                first = client.translate(None, ms.name, ms.version, **kw)  # the miss: maps and stores
                sizes = [2 * b.key.numel() * b.key.element_size() for b in first.blocks]
                request = wire.spec_to_pb(make_spec(None, ms.name, ms.version, **kw), pb.TranslateByKeyRequest).SerializeToString()
                calls = {"client": lambda: client.translate(None, ms.name, ms.version, **kw),
                         "bare": lambda: sum(len(m) for m in bare(request, timeout=60)),
                         "floor": lambda: sc.replay(sizes), "floor+2": lambda: sc.replay([60, *sizes, 40])}
                times = round_robin_ms(calls, a.reps)
                med = {v: statistics.median(t) for v, t in times.items()}
                results[n] = {"median_ms": med, "client_share_ms": med["client"] - med["bare"],
                              "sidecar_share_ms": med["bare"] - med["floor+2"]}
                print(f"n={n}: " + " | ".join(f"{v} {m:.2f}" for v, m in med.items()) + f" ms; client share "
                      f"{results[n]['client_share_ms']:.2f}, sidecar share {results[n]['sidecar_share_ms']:.2f} ms", flush=True)
    finally:
        redis_server.stop()
    write_json(a.json, results)


if __name__ == "__main__":
    main()
