"""``kvferry bench hits``: the prefix store's hit path against a raw GET, and hit vs miss TTFT.

Side by side in one run, per prompt length n (a real redis-server is started on a free loopback
port unless --redis-url is given):
  hit path      key-only Translate whose target blocks are all in Redis (no compute), over gRPC;
  raw GET       redis-py MGET of the same target blocks' bytes, no gRPC, no decoding;
  direct hit    the client reading the same mapped blocks from Redis itself (kvferry.client.direct: one MGET,
                checksums, a block per stored block and layer viewing the bytes), for pods trusted with the prefix
                secret;
  gRPC floor    the sidecar process streaming messages of the hit path's sizes to this one, from memory:
                the transport alone, which bounds what any hit path over gRPC can reach;
  region hit    the hit path with a response region (kvferry.v1 SharedRegion): the blocks' bytes written into a
                file on /dev/shm that this process maps, the messages carrying only where (a client sharing a
                memory volume with its sidecar, as in the chart's podSidecar mode);
  hit TTFT      hit path + import into T's cache + refresh of the last r tokens + first token;
  direct TTFT   the same from a direct hit (whose blocks are joined per layer by that import, not by the read);
  miss TTFT     the same, with the target blocks deleted first: the sidecar maps the stored source
                blocks, writes the result back, and streams it;
  cluster hit   the hit path through a second sidecar whose store is a real 3-master Redis Cluster started beside
                the single node (blocks spread over the masters, read with one pipelined MGET per slot), against
                the single node's hit, in turn each round (``--no-cluster`` leaves it out).
The sidecar runs in its own process (``kvferry.bench.server``), as in production.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvferry import paths
from kvferry.bench.refused import add_flag, banner, bench_map
from kvferry.pretrained import model_path


def run(a: argparse.Namespace) -> int:
    import contextlib

    import redis
    import torch

    from kvferry.client.client import ClientOptions, SharedMemory, TranslateClient
    from kvferry.client.direct import DirectReader
    from kvferry.client.importers import to_dynamic_cache
    from kvferry.common.prefix import map_id, map_namespaces, model_id
    from kvferry.common.prefix_cache import PrefixCache, publish_source
    from kvferry.common.stores import RedisStore
    from kvferry.mappings.lab.capture import capture_kv, load_model
    from kvferry.quiet import quiet_transformers

    from .harness import (
        RedisClusterServers,
        RedisServer,
        ServerProcess,
        long_ids,
        median_seconds,
        paired_ratio,
        round_robin_ms,
        shm_folder,
        spread,
    )

    quiet_transformers()
    redis_server = None if a.redis_url else RedisServer()
    url = a.redis_url or redis_server.url
    secret, bs, r = b"bench-secret", a.block_size, a.refresh
    source, target = load_model(a.source), load_model(a.target)
    raw = redis.Redis.from_url(url)
    rows = []
    cluster = RedisClusterServers() if a.cluster else None
    try:
        ms, served = bench_map(
            a.maps_dir, f"{source.identity.name}__{target.identity.name}", a.version, a.serve_refused_maps
        )
        refused = served is not None
        with (
            shm_folder() as shm,
            contextlib.ExitStack() as stack,
            ServerProcess(
                a.maps_dir,
                redis_url=url,
                prefix_secret=secret.decode(),
                prefix_block_size=bs,
                shm_dir=shm,
                serve_refused_maps=refused,
            ) as sc,
            TranslateClient(ClientOptions(target=sc.address, timeout=300)) as client,
            TranslateClient(
                ClientOptions(target=sc.address, timeout=300, shared_memory=SharedMemory(dir=shm))
            ) as shared,
            TranslateClient(
                ClientOptions(target=sc.address, timeout=300), direct=DirectReader(RedisStore(url), secret, bs)
            ) as near,
        ):
            kw = dict(source_geometry=ms.source.geometry.fingerprint, tokenizer=ms.source.tokenizer, tenant="bench")
            on_cluster = None
            if cluster is not None:
                csc = stack.enter_context(
                    ServerProcess(
                        a.maps_dir,
                        redis_url=cluster.url,
                        prefix_secret=secret.decode(),
                        prefix_block_size=bs,
                        serve_refused_maps=refused,
                    )
                )
                on_cluster = stack.enter_context(TranslateClient(ClientOptions(target=csc.address, timeout=300)))
            for n in a.sizes:
                ids = long_ids(target.tokenizer, n)
                prefix_ids = ids[0, : (n - r) // bs * bs].tolist()  # full blocks; the target refreshes the rest
                with torch.no_grad():
                    src = capture_kv(source.model, ids[:, : len(prefix_ids)])
                key = publish_source(
                    src, prefix_ids, ms.source, store=RedisStore(url), secret=secret, tenant="bench", block_size=bs
                )
                _, tgt_ns = map_namespaces(
                    "bench", model_id(ms.source), model_id(ms.target), map_id(ms.name, ms.version, ms.content_sha256)
                )
                tgt_keys = [tgt_ns.key(h) for h in PrefixCache(None, secret, bs).hashes(tgt_ns, prefix_ids)]
                m = len(prefix_ids)

                def translate(via=client):
                    return via.translate(None, ms.name, ms.version, token_ids=prefix_ids, prefix_key=key, **kw)

                @torch.no_grad()
                def ttft(via=client):
                    res = translate(via)
                    cache = to_dynamic_cache(res.layers(), target.model.config)
                    return int(target.model(input_ids=ids[:, m:], past_key_values=cache).logits[0, -1].argmax())

                def miss_ttft():
                    raw.delete(*tgt_keys)
                    t0 = time.perf_counter()
                    ttft()
                    return time.perf_counter() - t0

                translate()  # miss: maps and writes back
                first = translate()
                rounds = {
                    "hit": translate,
                    "get": lambda: raw.mget(tgt_keys),
                    "floor": lambda: sc.replay(sizes),
                    "direct": lambda: translate(near),
                    "region": lambda: translate(shared),
                }
                if on_cluster is not None:
                    publish_source(
                        src,
                        prefix_ids,
                        ms.source,
                        store=RedisStore(cluster.url),
                        secret=secret,
                        tenant="bench",
                        block_size=bs,
                    )
                    translate(on_cluster)  # the miss: maps and writes back to the cluster
                    assert translate(on_cluster).stats.cached_blocks == len(tgt_keys), (
                        "the cluster's blocks were not all cached"
                    )
                    rounds["cluster"] = lambda: translate(on_cluster)
                assert first.stats.cached_blocks == len(tgt_keys), "target blocks were not all cached"
                nbytes = sum(len(b) for b in raw.mget(tgt_keys))
                sizes = [2 * b.key.numel() * b.key.element_size() for b in first.blocks]
                assert translate(near).stats.extra.get("path") == "direct", "the direct reader missed"
                assert translate(shared).info.response_region, "the sidecar did not take the response region"
                # taken in turn within each round, so the machine's drift hits the hit and its bounds alike
                times = round_robin_ms(rounds, a.reps)
                t_hit, t_get, t_floor, t_direct, t_region = (
                    statistics.median(times[k]) / 1e3 for k in ("hit", "get", "floor", "direct", "region")
                )
                t_hit_ttft = median_seconds(ttft, a.reps)
                t_direct_ttft = median_seconds(lambda: ttft(near), a.reps)
                t_miss_ttft = statistics.median([miss_ttft() for _ in range(a.reps)])
                out_bytes = first.stats.bytes_out
                row = {
                    "n": n,
                    "cached_tokens": m,
                    "blocks": len(tgt_keys),
                    "redis_bytes": nbytes,
                    "hit_ms": t_hit * 1e3,
                    "raw_get_ms": t_get * 1e3,
                    "grpc_floor_ms": t_floor * 1e3,
                    "direct_ms": t_direct * 1e3,
                    "hit_MiB_s": out_bytes / t_hit / 2**20,
                    "raw_get_MiB_s": nbytes / t_get / 2**20,
                    "grpc_floor_MiB_s": sum(sizes) / t_floor / 2**20,
                    "hit_ttft_ms": t_hit_ttft * 1e3,
                    "direct_ttft_ms": t_direct_ttft * 1e3,
                    "miss_ttft_ms": t_miss_ttft * 1e3,
                }
                row["hit_vs_get"] = row["hit_MiB_s"] / row["raw_get_MiB_s"]
                row["direct_vs_get"] = t_get / t_direct * out_bytes / nbytes
                row["floor_vs_get"] = row["grpc_floor_MiB_s"] / row["raw_get_MiB_s"]
                row["hit_serial_bound_ms"] = row["raw_get_ms"] + row["grpc_floor_ms"]  # GET, then send the same bytes
                row["bound_vs_hit"] = row["hit_serial_bound_ms"] / row["hit_ms"]  # the target: >= 0.8
                # the same ratios taken within each round (median and quartiles over the rounds)
                row["bound_vs_hit_paired"] = paired_ratio(times, ("get", "floor"), ("hit",))
                row["region_hit_ms"] = t_region * 1e3  # the same hit, its bytes through a response region
                row["bound_vs_region_hit"] = row["hit_serial_bound_ms"] / row["region_hit_ms"]
                row["bound_vs_region_hit_paired"] = paired_ratio(times, ("get", "floor"), ("region",))
                row["direct_vs_get_paired"] = {
                    k: v * out_bytes / nbytes for k, v in paired_ratio(times, ("get",), ("direct",)).items()
                }
                if "cluster" in times:
                    row["cluster_hit_ms"] = statistics.median(times["cluster"])
                    row["hit_vs_cluster_hit_paired"] = paired_ratio(
                        times, ("hit",), ("cluster",)
                    )  # single node's time / cluster's
                row["refused_map_served"] = served
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    finally:
        if redis_server:
            redis_server.stop()
        if cluster is not None:
            cluster.stop()
    if served:
        print("\n" + banner(served))
    print(
        f"\nmap {ms.name} {ms.version}; prefix blocks of {bs} tokens; r={r}; medians of {a.reps} (hit, GET, floor, "
        "direct "
        "and region hit taken in turn each round)\n"
    )
    print(
        "| n | cached tokens | hit path ms | raw GET ms | gRPC floor ms | serial bound (GET + floor) ms | bound/hit "
        "| per round: median [quartiles] | region hit ms | bound/region hit | per round: median [quartiles] "
        "| direct hit ms | direct/GET | per round: median [quartiles] | hit MiB/s "
        "| raw GET MiB/s | hit/GET | floor/GET | hit TTFT ms | direct TTFT ms | miss TTFT ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for w in rows:
        print(
            f"| {w['n']} | {w['cached_tokens']} | {w['hit_ms']:.1f} | {w['raw_get_ms']:.1f} | "
            f"{w['grpc_floor_ms']:.1f} | "
            f"{w['hit_serial_bound_ms']:.1f} | {w['bound_vs_hit']:.2f} | {spread(w['bound_vs_hit_paired'])} | "
            f"{w['region_hit_ms']:.1f} | {w['bound_vs_region_hit']:.2f} | {spread(w['bound_vs_region_hit_paired'])} | "
            f"{w['direct_ms']:.1f} | {w['direct_vs_get']:.2f} | {spread(w['direct_vs_get_paired'])} | "
            f"{w['hit_MiB_s']:.0f} | {w['raw_get_MiB_s']:.0f} | {w['hit_vs_get']:.2f} | {w['floor_vs_get']:.2f} | "
            f"{w['hit_ttft_ms']:.1f} | {w['direct_ttft_ms']:.1f} | {w['miss_ttft_ms']:.1f} |"
        )
    if any("cluster_hit_ms" in w for w in rows):
        print("\n| n | single-node hit ms | 3-master cluster hit ms | single/cluster per round: median [quartiles] |")
        print("|---|---|---|---|")
        for w in rows:
            print(
                f"| {w['n']} | {w['hit_ms']:.1f} | {w['cluster_hit_ms']:.1f} | "
                f"{spread(w['hit_vs_cluster_hit_paired'])} |"
            )
    print(
        "\ntargets: bound/hit >= 0.8 (and the region hit against the same bound); direct/GET >= 0.6. The first "
        'ratio of each pair is of the medians; "per round" takes the ratio within each round (the calls ran back to '
        "back) and gives its median and quartiles"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def add_parser(sub) -> None:
    b = sub.add_parser(
        "hits", help="prefix-store hits through the sidecar vs a raw Redis GET, direct reads; hit vs miss TTFT"
    )
    b.add_argument("--source", type=model_path, default=paths.model_dir("S"))
    b.add_argument("--target", type=model_path, default=paths.model_dir("T"))
    b.add_argument("--maps-dir", type=Path, default=paths.maps_dir())
    b.add_argument("--version", default="")
    add_flag(b)
    b.add_argument("--redis-url", default="")
    b.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    b.add_argument("--block-size", type=int, default=256)
    b.add_argument("--refresh", type=int, default=16)
    b.add_argument("--reps", type=int, default=5)
    b.add_argument(
        "--no-cluster",
        dest="cluster",
        action="store_false",
        help="leave out the cluster column (a real 3-master Redis Cluster started beside the single node)",
    )
    b.add_argument("--json", default=None)
    b.set_defaults(func=run)
