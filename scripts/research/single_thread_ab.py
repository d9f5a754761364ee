"""Issue 16, session 17: gRPC Python's SingleThreadedUnaryStream channel option (client.SINGLE_THREADED_STREAMS) on a
key-only hit and on the gRPC floor, side by side: the same TranslateByKey request (serialised beforehand, the answer's
bytes only counted) and the same Replay of the hit's message sizes, over a channel with the option and one without,
called in turn (round robin) against one sidecar process and a real redis-server:

    .venv/bin/python scripts/research/single_thread_ab.py --sizes 272 2048 8192 --reps 31 --json runs/results/single_thread_ab.json
"""

from __future__ import annotations

import statistics
import struct

import grpc

from hit_setup import BS, SECRET, bench_pair, hit_args  # scripts/research/hit_setup.py (beside this script)
from kvferry import paths
from kvferry.bench.harness import RedisServer, ServerProcess, published_prefix, round_robin_ms, write_json
from kvferry.bench.server import REPLAY_METHOD
from kvferry.client.client import BY_KEY_METHOD, SINGLE_THREADED_STREAMS, ClientOptions, TranslateClient, make_spec
from kvferry.common import wire
from kvferry.common.stores import RedisStore
from kvferry.v1 import translate_pb2 as pb


def main() -> None:
    a = hit_args(reps=31)
    ms, source, target = bench_pair()
    redis_server, results = RedisServer(), {}
    limits = [("grpc.max_receive_message_length", 64 << 20)]
    try:
        with ServerProcess(paths.maps_dir(), redis_url=redis_server.url, prefix_secret=SECRET.decode(), prefix_block_size=BS) as sc, \
                TranslateClient(ClientOptions(target=sc.address, timeout=300)) as client:
            channels = {"threaded": grpc.insecure_channel(sc.address, limits),
                        "single": grpc.insecure_channel(sc.address, [*limits, SINGLE_THREADED_STREAMS])}
            for n in a.sizes:
                _, _, kw = published_prefix(source, target, ms, RedisStore(redis_server.url), SECRET, n, BS)
                first = client.translate(None, ms.name, ms.version, **kw)  # the miss: maps and stores
                sizes = struct.pack(f"<{len(first.blocks)}I", *(2 * b.key.numel() * b.key.element_size() for b in first.blocks))
                request = wire.spec_to_pb(make_spec(None, ms.name, ms.version, **kw), pb.TranslateByKeyRequest).SerializeToString()
                calls = {}
                for name, ch in channels.items():
                    hit, replay = ch.unary_stream(BY_KEY_METHOD), ch.unary_stream(REPLAY_METHOD)
                    calls[f"hit {name}"] = lambda hit=hit: sum(len(m) for m in hit(request, timeout=60))
                    calls[f"floor {name}"] = lambda replay=replay: sum(len(m) for m in replay(sizes, timeout=60))
                med = {k: statistics.median(t) for k, t in round_robin_ms(calls, a.reps).items()}
                results[n] = {"median_ms": med}
                print(f"n={n}: " + " | ".join(f"{k} {v:.2f}" for k, v in med.items()) + f" ms (medians of {a.reps})", flush=True)
            for ch in channels.values():
                ch.close()
    finally:
        redis_server.stop()
    write_json(a.json, results)


if __name__ == "__main__":
    main()
