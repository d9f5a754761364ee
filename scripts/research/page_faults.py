"""Issue 16, session 18: are page faults a cost of the hit path, so that glibc's malloc thresholds (mmap and trim, which
decide whether freed message buffers go back to the OS and come back as fresh pages to fault in) would be a lever?
Minor faults per key-only hit, in the client (this process) and in the sidecar process, for a hit through the sidecar
and a direct read, after warm-up calls.

    .venv/bin/python scripts/research/page_faults.py --sizes 2048 8192 --reps 20 --json runs/results/page_faults.json
"""

from __future__ import annotations

import resource

from hit_setup import BS, SECRET, bench_pair, hit_args  # scripts/research/hit_setup.py (beside this script)
from kvferry import paths
from kvferry.bench.harness import RedisServer, ServerProcess, published_prefix, write_json
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.client.direct import DirectReader
from kvferry.common.stores import RedisStore


def minor_faults(pid: int) -> int:
    """A process's minor page faults so far (field 10 of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def main() -> None:
    a = hit_args(sizes=(2048, 8192), reps=20)
    ms, source, target = bench_pair()
    redis_server, results = RedisServer(), {}
    mine = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # noqa: E731
    try:
        store = RedisStore(redis_server.url)
        with ServerProcess(paths.maps_dir(), redis_url=redis_server.url, prefix_secret=SECRET.decode(), prefix_block_size=BS) as sc, \
                TranslateClient(ClientOptions(target=sc.address, timeout=300)) as client, \
                TranslateClient(ClientOptions(target=sc.address, timeout=300), direct=DirectReader(store, SECRET, BS)) as near:
            for n in a.sizes:
                _, _, kw = published_prefix(source, target, ms, store, SECRET, n, BS)
                client.translate(None, ms.name, ms.version, **kw)  # the miss: maps and stores
                for name, via in (("sidecar hit", client), ("direct read", near)):
                    for _ in range(3):
                        via.translate(None, ms.name, ms.version, **kw)
                    side, own = minor_faults(sc.proc.pid), mine()
                    for _ in range(a.reps):
                        via.translate(None, ms.name, ms.version, **kw)
                    row = {"sidecar": (minor_faults(sc.proc.pid) - side) / a.reps, "client": (mine() - own) / a.reps}
                    results.setdefault(n, {})[name] = row
                    print(f"n={n} {name}: minor faults per call: sidecar {row['sidecar']:.1f}, client {row['client']:.1f}",
                          flush=True)
    finally:
        redis_server.stop()
    write_json(a.json, results)


if __name__ == "__main__":
    main()
