"""Issue 16, sessions 18 and 19: a key-only hit asked for in vLLM's paged layout (--page tokens a page: 16 is vLLM's
default on GPUs, 128 its CPU build's), one page a message and (session 19, pages_per_block) as many as fit one, against
the same hit contiguous, and the ways of writing it into a vLLM-shaped paged cache, called in turn (round robin),
medians:

  contiguous / paged / paged many in-process   the sidecar's key-only path without gRPC (store read, session,
                                               messages encoded)
  contiguous / paged / paged many rpc          TranslateClient.translate through a sidecar process
  import pages                   a paged answer written page by page (the vLLM connector through session 17)
  import pages many              the many-pages answer written with one indexed write a block
  import contiguous              the contiguous answer written with importers.write_pages (one indexed write a block)

    .venv/bin/python scripts/research/paged_hit.py --sizes 2048 8192 --reps 15 --page 16 --json runs/results/paged_hit.json
"""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor

import torch

from hit_setup import BS, SECRET, bench_pair, hit_args  # scripts/research/hit_setup.py (beside this script)
from kvferry import paths
from kvferry.bench.harness import RedisServer, ServerProcess, published_prefix, round_robin_ms, write_json
from kvferry.client.client import ClientOptions, TranslateClient, make_spec
from kvferry.client.importers import vllm_cpu_views, write_pages
from kvferry.common import wire
from kvferry.common.stores import RedisStore
from kvferry.sidecar.config import SidecarConfig
from kvferry.sidecar.metrics import Metrics
from kvferry.sidecar.prefix_flow import PrefixService

def vllm_like_cache(pages: int, page: int, heads: int, dim: int, dtype: torch.dtype):
    """K and V views [pages, heads, page, dim] of a zeroed layer of vLLM's CPU cache (the K view strided)."""
    return vllm_cpu_views(torch.zeros(pages, heads, page, 2 * dim, dtype=dtype))


def main() -> None:
    def more(ap):
        ap.add_argument("--page", type=int, default=16)
        ap.add_argument("--map-threads", type=int, default=0, help="the sidecar's map_threads (1: as before session 20)")

    a = hit_args(sizes=(2048, 8192), reps=15, more=more)
    page = a.page
    ms, source, target = bench_pair()
    g = ms.target.geometry
    redis_server, results = RedisServer(), {}
    try:
        cfg = SidecarConfig(maps_dir=str(paths.maps_dir()), redis_url=redis_server.url, prefix_secret=SECRET.decode(),
                            prefix_block_size=BS)
        service, compute = PrefixService(cfg, Metrics()), ThreadPoolExecutor(1)
        with ServerProcess(paths.maps_dir(), redis_url=redis_server.url, prefix_secret=SECRET.decode(), prefix_block_size=BS,
                           map_threads=a.map_threads) as sc, \
                TranslateClient(ClientOptions(target=sc.address, timeout=300)) as client:
            for n in a.sizes:
                _, _, kw = published_prefix(source, target, ms, RedisStore(redis_server.url), SECRET, n, BS)
                client.translate(None, ms.name, ms.version, **kw)  # the miss: maps and stores
                layouts = {"contiguous": {}, "paged": {"layout": "paged", "block_size": page, "pages_per_block": 0},
                           "paged many": {"layout": "paged", "block_size": page}}

                def in_process(extra):
                    spec = make_spec(None, ms.name, ms.version, **kw, **extra)

                    def call():
                        _, initial, _ = service.from_store(spec, ms, cfg.limits, compute)
                        return [wire.encode_block_response(b) for b in initial]
                    return call

                answers = {name: client.translate(None, ms.name, ms.version, **kw, **extra) for name, extra in layouts.items()}
                tokens = answers["contiguous"].info.num_tokens
                table = list(range(-(-tokens // page)))[::-1]  # pages in reverse, so that order matters
                caches = {name: [vllm_like_cache(len(table), page, g.kv_heads, g.head_dim, torch.bfloat16) for _ in range(g.layers)]
                          for name in layouts}

                def import_pages():  # the connector's loop through session 17
                    for b in answers["paged"].blocks:  # [1, page, H, D] each
                        k_view, v_view = caches["paged"][b.layer]
                        k_view[table[b.start // page]].copy_(b.key[0].transpose(0, 1).to(k_view.dtype))
                        v_view[table[b.start // page]].copy_(b.value[0].transpose(0, 1).to(v_view.dtype))

                def import_pages_many():  # [pages, page, H, D] each: one indexed write a block and tensor
                    for b in answers["paged many"].blocks:
                        k_view, v_view = caches["paged many"][b.layer]
                        phys = torch.as_tensor(table[b.index : b.index + b.key.shape[0]])
                        k_view[phys] = b.key.transpose(1, 2).to(k_view.dtype)
                        v_view[phys] = b.value.transpose(1, 2).to(v_view.dtype)

                def import_contiguous():
                    for b in answers["contiguous"].blocks:
                        write_pages(b, *caches["contiguous"][b.layer], table)

                calls = {**{f"{name} in-process": in_process(extra) for name, extra in layouts.items()},
                         **{f"{name} rpc": (lambda extra=extra: client.translate(None, ms.name, ms.version, **kw, **extra))
                            for name, extra in layouts.items()},
                         "import pages": import_pages, "import pages many": import_pages_many,
                         "import contiguous": import_contiguous}
                times = round_robin_ms(calls, a.reps)
                for name in ("paged", "paged many"):  # every import wrote the same cache
                    for (pk, pv), (ck, cv) in zip(caches[name], caches["contiguous"]):
                        assert torch.equal(pk, ck) and torch.equal(pv, cv)
                med = {v: statistics.median(t) for v, t in times.items()}
                results[n] = {"median_ms": med, "messages": {name: len(r.blocks) for name, r in answers.items()}, "reps": a.reps,
                              "page": page}
                print(f"n={n}, pages of {page}: " + " | ".join(f"{v} {m:.2f}" for v, m in med.items()) + f" ms (medians of {a.reps}); messages "
                      + ", ".join(f"{name} {len(r.blocks)}" for name, r in answers.items()), flush=True)
    finally:
        redis_server.stop()
    write_json(a.json, results)


if __name__ == "__main__":
    main()
