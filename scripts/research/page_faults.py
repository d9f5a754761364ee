import sys, resource
sys.path.insert(0, "scripts/research")
from hit_setup import BS, SECRET, bench_pair
from kvferry import paths
from kvferry.bench.harness import RedisServer, ServerProcess, published_prefix
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.client.direct import DirectReader
from kvferry.common.stores import RedisStore
ms, source, target = bench_pair()
rs = RedisServer()
def flt(pid): return int(open(f"/proc/{pid}/stat").read().rsplit(")",1)[1].split()[7])
try:
    store = RedisStore(rs.url)
    with ServerProcess(paths.maps_dir(), redis_url=rs.url, prefix_secret=SECRET.decode(), prefix_block_size=BS) as sc, \
            TranslateClient(ClientOptions(target=sc.address, timeout=300)) as client, \
            TranslateClient(ClientOptions(target=sc.address, timeout=300), direct=DirectReader(store, SECRET, BS)) as near:
        for n in (2048, 8192):
            prefix, key, kw = published_prefix(source, target, ms, store, SECRET, n, BS)
            for _ in range(3): client.translate(None, ms.name, ms.version, **kw)
            for name, c in (("hit", client), ("direct", near)):
                for _ in range(3): c.translate(None, ms.name, ms.version, **kw)
                s0, c0 = flt(sc.proc.pid), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                for _ in range(20): c.translate(None, ms.name, ms.version, **kw)
                print(n, name, "sidecar faults/call", (flt(sc.proc.pid)-s0)/20, "client faults/call", (resource.getrusage(resource.RUSAGE_SELF).ru_minflt-c0)/20, flush=True)
finally:
    rs.stop()
