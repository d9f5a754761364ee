"""Issue 16 levers on the hit path, side by side: key-only hits (every target block stored) against sidecar processes
that differ in one thing, called in turn (round robin) so the machine's drift hits every variant alike. The shipped
S__T map and a real redis-server; the gRPC floor of the same message sizes is timed in the same rounds.

Variants:
  shipped         the sidecar as committed: a key-only hit's session is built on the compute thread (I/O thread ->
                  compute thread -> I/O thread)
  no_compute_hop  the session built on the I/O thread that read the store (a stored contiguous hit does no tensor
                  work, so it needs no hop): measured in session 13 and not kept (no gain)
  keep_memory     the shipped sidecar with glibc's malloc told to keep freed memory (MALLOC_MMAP_THRESHOLD_ 256 MiB,
                  MALLOC_TRIM_THRESHOLD_ 1 GiB): a hit's multi-MiB buffers (the blobs, the messages, gRPC's copies) are
                  then reused, not mapped fresh and faulted in page by page
  on_the_loop     a key-only request's whole store read (hashes, MGET, blob checks, session) run on the event loop
                  itself, blocking it: no thread hand-off at all (an upper bound on what the hand-offs cost)
  direct_writes   each response message written and awaited in turn (no task per write, no overlap of a write with
                  building the next message)
  switch_0.5ms    the shipped sidecar with Python's GIL switch interval at 0.5 ms (default 5 ms): do the event loop and
                  the store's I/O thread wait on each other for the GIL?
  map_threads_1   (session 20) the sidecar as before session 20: the compute thread on torch's two-thread pool, no
                  token slices (map_threads = 1); "shipped" maps in two token lanes (session 21; slices in session 20)
  no_get          not a lever: the sidecar answers a repeated MGET from memory (the same bytes objects), so the hit
                  costs everything but the store read; against the floor, what the sidecar and client add

    .venv/bin/python scripts/research/hit_ab.py --sizes 272 2048 8192 --reps 31 --json runs/results/hit_ab.json
"""

from __future__ import annotations

import statistics

from hit_setup import BS, SECRET, bench_pair, hit_args  # scripts/research/hit_setup.py (beside this script)
from translate_ab import SWITCH  # scripts/research/translate_ab.py (beside this script)
from kvferry import paths
from kvferry.bench.harness import RedisServer, ServerProcess, published_prefix, round_robin_ms, write_json
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.common.stores import RedisStore

KEEP_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
ENV = {"keep_memory": KEEP_MEMORY}
FLAGS = {"map_threads_1": {"map_threads": 1}}  # bench server flags of a variant
VARIANTS = {
    "shipped": "",
    "map_threads_1": "",
    "keep_memory": "",
    "no_compute_hop": ("import concurrent.futures as cf, kvferry.sidecar.prefix_flow as pf\n"
                       "class Inline:\n"
                       "    def __init__(self, pool):\n"
                       "        self.pool = pool\n"
                       "    def submit(self, fn, *a):\n"
                       "        if fn is not pf.start_session:\n"
                       "            return self.pool.submit(fn, *a)\n"
                       "        done = cf.Future()\n"
                       "        done.set_result(fn(*a))\n"
                       "        return done\n"
                       "real = pf.PrefixService.from_store\n"
                       "pf.PrefixService.from_store = lambda self, spec, ms, limits, compute: real(self, spec, ms, limits, Inline(compute))\n"
                       "import kvferry.bench.server as s\ns.main()\n"),
    "on_the_loop": ("import concurrent.futures as cf, kvferry.sidecar.flow as fl, kvferry.sidecar.prefix_flow as pf\n"
                    "class Inline:\n"
                    "    def submit(self, fn, *a):\n"
                    "        done = cf.Future()\n"
                    "        done.set_result(fn(*a))\n"
                    "        return done\n"
                    "real_open = fl.TranslateFlow.open\n"
                    "async def open_inline(self, spec):\n"
                    "    if not spec.prefix_key:\n"
                    "        return await real_open(self, spec)\n"
                    "    ms = self.registry.resolve(spec.map_name, spec.map_version)\n"
                    "    self.limits.check(spec.num_tokens, 0)\n"
                    "    session, initial, cached = self.prefix.from_store(spec, ms, self.limits, Inline())\n"
                    "    return fl.Opened(session, ms, None, cached, initial)\n"
                    "fl.TranslateFlow.open = open_inline\n"
                    "import kvferry.bench.server as s\ns.main()\n"),
    "direct_writes": ("import kvferry.sidecar.servicer as sv\n"
                      "async def send(self, msg):\n"
                      "    await self._write(msg)\n"
                      "sv._Sender.send = send\n"
                      "import kvferry.bench.server as s\ns.main()\n"),
    "switch_0.5ms": SWITCH,
    "no_get": ("import kvferry.common.stores as st\n"
               "real_get, seen = st.RedisStore.get_many, {}\n"
               "def remembered(self, keys):\n"
               "    k = tuple(keys)\n"
               "    if k not in seen or None in seen[k]:\n"
               "        seen[k] = real_get(self, keys)\n"
               "    return seen[k]\n"
               "st.RedisStore.get_many = remembered\n"
               "import kvferry.bench.server as s\ns.main()\n"),
}


def main() -> None:
    a = hit_args(reps=31, more=lambda ap: ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS)))
    ms, source, target = bench_pair()
    redis_server, results = RedisServer(), {}
    servers = {}
    try:
        for v in a.variants:
            servers[v] = ServerProcess(paths.maps_dir(), code=VARIANTS[v], env=ENV.get(v), redis_url=redis_server.url,
                                       prefix_secret=SECRET.decode(), prefix_block_size=BS, **FLAGS.get(v, {}))
        clients = {v: TranslateClient(ClientOptions(target=sc.address, timeout=300)) for v, sc in servers.items()}
        store = RedisStore(redis_server.url)
        for n in a.sizes:
            prefix, _, kw = published_prefix(source, target, ms, store, SECRET, n, BS)
            call = {v: (lambda c=c: c.translate(None, ms.name, ms.version, **kw)) for v, c in clients.items()}
            first = call[a.variants[0]]()  # the miss: maps and stores; every variant then hits
            sizes = [2 * b.key.numel() * b.key.element_size() for b in first.blocks]
            for v in a.variants:
                assert call[v]().stats.cached_blocks == len(prefix) // BS, v
            times = round_robin_ms({**call, "floor": lambda: servers[a.variants[0]].replay(sizes)}, a.reps)
            med = {v: statistics.median(t) for v, t in times.items()}
            results[n] = {"median_ms": med, "min_ms": {v: min(t) for v, t in times.items()}}
            print(f"n={n}: " + " | ".join(f"{v} {m:.2f}" for v, m in med.items()) + " ms (medians of "
                  f"{a.reps}, round robin)", flush=True)
        for c in clients.values():
            c.close()
    finally:
        for sc in servers.values():
            sc.close()
        redis_server.stop()
    write_json(a.json, results)


if __name__ == "__main__":
    main()
