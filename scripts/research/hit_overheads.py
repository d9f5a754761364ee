"""Where a prefix-store hit's time goes (issue 16), for the shipped S__T map and a real redis-server:

  in-process   the sidecar's key-only path without gRPC (hashes, MGET, blob checks, messages built) and the
               client's direct read (the same, joined into tensors), medians of 15;
  end to end   a key-only Translate through a sidecar process (min and median of 21) beside the gRPC floor of
               the same message sizes;
  call cost    one message through a stream-stream call (what Translate is) and a unary-stream one (the floor).

    .venv/bin/python scripts/research/hit_overheads.py --sizes 272 2048 8192
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvferry import paths
from kvferry.bench.harness import RedisServer, ServerProcess, published_prefix
from kvferry.client.client import ClientOptions, TranslateClient, make_spec
from kvferry.client.direct import DirectReader
from kvferry.common import wire
from kvferry.common.stores import RedisStore
from kvferry.mappings.capture import load_model
from kvferry.sidecar.config import SidecarConfig
from kvferry.sidecar.metrics import Metrics
from kvferry.sidecar.prefix_flow import PrefixService
from kvferry.sidecar.registry import MapRegistry
from kvferry.sidecar.servicer import mapping_info

SECRET, BS = b"bench-secret", 256


def times(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[272, 2048, 8192])
    a = ap.parse_args()
    torch.set_num_threads(2)
    registry = MapRegistry(paths.maps_dir(), force=True)
    registry.scan()
    ms = registry.resolve("S__T", "")
    info = [mapping_info(e, "mapped_refresh") for e in registry.entries("S__T") if e.maps.version == ms.version][0]
    source, target = load_model(paths.model_dir("S")), load_model(paths.model_dir("T"))
    redis_server = RedisServer()
    try:
        cfg = SidecarConfig(maps_dir=str(paths.maps_dir()), redis_url=redis_server.url, prefix_secret=SECRET.decode(),
                            prefix_block_size=BS)
        service, compute = PrefixService(cfg, Metrics()), ThreadPoolExecutor(1)
        direct = DirectReader(RedisStore(redis_server.url), SECRET, BS)
        with ServerProcess(paths.maps_dir(), redis_url=redis_server.url, prefix_secret=SECRET.decode(),
                           prefix_block_size=BS) as sc, TranslateClient(ClientOptions(target=sc.address, timeout=300)) as client:
            for n in a.sizes:
                prefix, key, kw = published_prefix(source, target, ms, RedisStore(redis_server.url), SECRET, n, BS)
                spec = make_spec(None, ms.name, ms.version, **kw)

                def sidecar_in_process():
                    _, initial, _ = service.from_store(spec, ms, cfg.limits, compute)
                    return [wire.encode_block_response(b) for b in initial]

                translate = lambda: client.translate(None, ms.name, ms.version, **kw)  # noqa: E731
                first = translate()  # the miss: maps and writes back
                sizes = [2 * b.key.numel() * b.key.element_size() for b in first.blocks]
                hit, floor = times(translate, 21), times(lambda: sc.replay(sizes), 21)
                print(f"n={n}: in-process sidecar hit {statistics.median(times(sidecar_in_process, 15)):.2f} ms, "
                      f"direct read {statistics.median(times(lambda: direct.read(info, prefix, key, 'bench'), 15)):.2f} ms; "
                      f"through gRPC: hit min {hit[0]:.2f} median {hit[10]:.2f} ms, floor median {floor[10]:.2f} ms "
                      f"({len(sizes)} messages)", flush=True)
            stream = times(lambda: sc.roundtrip([b"x" * 100]), 201)
            unary = times(lambda: sc.replay([100]), 201)
            print(f"call cost, one 100-byte message: stream-stream {stream[100]:.2f} ms, unary-stream {unary[100]:.2f} ms")
    finally:
        redis_server.stop()


if __name__ == "__main__":
    main()
