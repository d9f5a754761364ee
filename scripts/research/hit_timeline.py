"""Where a key-only hit's time goes, call by call (issue 16): one timeline from both processes' monotonic clocks.

The sidecar runs in its own process with its flow wrapped to note when each step starts and ends (the handler, the
store read, the session, every write); the client notes when each response message arrives. Per size, the phases
of the median call (by total), and the medians of each phase over ``--reps`` calls, beside the gRPC floor of the
same message sizes:

    .venv/bin/python scripts/research/hit_timeline.py --sizes 272 2048 8192 --reps 31

Phases: call -> handler (gRPC call set-up, the header message's trip), handler -> open (the first request message
read and parsed), open (the store's hashes, MGET, blob checks and the session: "lookup" is the MGET and checks),
send (the first write to the trailer's), and client tail (the trailer's arrival to the call's return).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from hit_setup import BS, SECRET, bench_pair, hit_args  # scripts/research/hit_setup.py (beside this script)
from timeline import NOTES, timed_calls  # scripts/research/timeline.py (beside this script)
from kvferry import paths
from kvferry.bench.harness import RedisServer, ServerProcess, published_prefix
from kvferry.client import client as client_module
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.common.stores import RedisStore


SERVER_NOTES = NOTES + '''
from kvferry.common import prefix_cache
from kvferry.sidecar import flow, prefix_flow, servicer
around(servicer.TranslateServicer, "Translate")
around(servicer.TranslateServicer, "TranslateByKey")
around(flow.TranslateFlow, "open")
around(prefix_flow.PrefixService, "from_store")
around(prefix_cache.PrefixCache, "lookup")
around(servicer._Sender, "_write")
from kvferry.bench import server
server.main()
'''


def phases(events: list[tuple[str, float]]) -> dict[str, float]:
    """Milliseconds per phase of one call's sorted (name, ms since the call) events."""
    first = {}
    last = {}
    for name, t in events:
        first.setdefault(name, t)
        last[name] = t
    handler = first.get("TranslateByKey>", first.get("Translate>"))  # key-only calls go through TranslateByKey
    return {"call->handler": handler, "handler->open": first["open>"] - handler,
            "open": last["open<"] - first["open>"], "lookup": first["lookup<"] - first["lookup>"],
            "send": last["_write<"] - first["_write>"], "client tail": last["return"] - last["_write<"],
            "total": last["return"]}


def main() -> None:
    a = hit_args(reps=31)
    ms, source, target = bench_pair()
    marks: list[tuple[str, float]] = []
    take = client_module._Collector.take

    def noting_take(self, msg):
        take(self, msg)
        marks.append(("msg", time.perf_counter()))

    client_module._Collector.take = noting_take
    log = Path(tempfile.mkdtemp()) / "timeline.jsonl"
    log.touch()
    redis_server, results = RedisServer(), {}
    try:
        with ServerProcess(paths.maps_dir(), code=SERVER_NOTES, env={"KVFERRY_TIMELINE": str(log)}, redis_url=redis_server.url,
                           prefix_secret=SECRET.decode(), prefix_block_size=BS) as sc, \
                TranslateClient(ClientOptions(target=sc.address, timeout=300)) as client:
            raw = RedisStore(redis_server.url)
            for n in a.sizes:
                _, _, kw = published_prefix(source, target, ms, raw, SECRET, n, BS)
                first = client.translate(None, ms.name, ms.version, **kw)  # the miss
                sizes = [2 * b.key.numel() * b.key.element_size() for b in first.blocks]
                calls = timed_calls(lambda: client.translate(None, ms.name, ms.version, **kw), log, marks, a.reps)
                per = [phases(c) for c in calls]
                floor = sorted(_ms(lambda: sc.replay(sizes)) for _ in range(a.reps))
                med = {k: statistics.median(p[k] for p in per) for k in per[0]}
                calls.sort(key=lambda c: c[-1][1])
                results[n] = {"phase_medians_ms": med, "floor_median_ms": floor[len(floor) // 2],
                              "median_call": calls[len(calls) // 2], "messages": len(sizes) + 2}
                print(f"n={n}: " + " | ".join(f"{k} {v:.2f}" for k, v in med.items())
                      + f" ms; gRPC floor {floor[len(floor) // 2]:.2f} ms ({len(sizes)} blocks)", flush=True)
                print("   median call: " + "  ".join(f"{name}@{t:.2f}" for name, t in calls[len(calls) // 2]), flush=True)
    finally:
        redis_server.stop()
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=1))


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


if __name__ == "__main__":
    main()
