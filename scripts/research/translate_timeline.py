"""Where a streamed Translate's time goes (issue 16): one timeline from both processes' monotonic clocks, as
hit_timeline.py does for key-only hits. The sidecar notes when each chunk arrives and each map step and write starts
and ends; the client notes when it sends each request message and when each response message arrives. Per size,
the phase medians over ``--reps`` calls and the median call's events:

    .venv/bin/python scripts/research/translate_timeline.py --sizes 2048 8192 --reps 9
    .venv/bin/python scripts/research/translate_timeline.py --source models/pretrained/smollm2-135m-l25 \
        --target models/pretrained/smollm2-135m --sizes 2048 --reps 5

Phases: call -> handler (gRPC call set-up and the header's trip); upload (the client's first chunk sent to the last
one received by the sidecar); compute (the sum of the sidecar's map steps, ``TranslateFlow.add``); compute after
upload (map work still running once the last chunk arrived); writes after compute (the last map step's end to the
last write's end); client tail (the last write to the call's return).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hit_setup import bench_pair, hit_args  # scripts/research/hit_setup.py (beside this script)
from timeline import NOTES, timed_calls  # scripts/research/timeline.py (beside this script)
from kvferry import paths
from kvferry.bench.harness import ServerProcess, long_ids
from kvferry.client import client as client_module
from kvferry.client.client import ClientOptions, TranslateClient
from kvferry.mappings.capture import capture_kv, load_model
from kvferry.sidecar.registry import MapRegistry

SERVER_NOTES = NOTES + '''
from kvferry.sidecar import flow, servicer
around(servicer.TranslateServicer, "Translate")
around(flow.TranslateFlow, "open")
around(flow.TranslateFlow, "add")
around(flow.TranslateFlow, "poll")
around(flow.TranslateFlow, "drain")
around(servicer._Sender, "_write")
before = servicer._before
async def noting_before(requests, deadline):
    async for msg in before(requests, deadline):
        note("chunk"); yield msg
servicer._before = noting_before
from kvferry.bench import server
server.main()
'''


def phases(events: list[tuple[str, float]]) -> dict[str, float]:
    """Milliseconds per phase of one call's sorted (name, ms since the call) events."""
    first, last, spans, opened = {}, {}, {"add": 0.0}, {}
    for name, t in events:
        first.setdefault(name, t)
        last[name] = t
        if name == "add>":
            opened["add"] = t
        elif name == "add<":
            spans["add"] += t - opened.pop("add")
    return {"call->handler": first["Translate>"], "upload": last["chunk"] - first["sent"], "compute": spans["add"],
            "compute after upload": max(0.0, last["add<"] - last["chunk"]), "writes after compute": last["_write<"] - last["add<"],
            "client tail": last["return"] - last["_write<"], "total": last["return"]}


def main() -> None:
    a = hit_args(sizes=(2048, 8192), reps=9, more=lambda ap: (ap.add_argument("--source", type=Path),
                                                               ap.add_argument("--target", type=Path),
                                                               ap.add_argument("--map-threads", type=int, default=0),
                                                               ap.add_argument("--chunk-tokens", type=int, default=0)))
    ms, source, target = bench_pair()
    if a.source:  # another pair than the tiny family's: its newest servable map
        source, target = load_model(a.source), load_model(a.target)
        registry = MapRegistry(paths.maps_dir(), force=True)
        registry.scan()
        ms = registry.resolve(f"{source.identity.name}__{target.identity.name}", "")
    marks: list[tuple[str, float]] = []
    take, encode = client_module._Collector.take, client_module.encode_requests

    def noting_take(self, msg):
        take(self, msg)
        marks.append(("msg", time.perf_counter()))

    def noting_encode(*args, **kw):
        for m in encode(*args, **kw):
            marks.append(("sent", time.perf_counter()))
            yield m

    client_module._Collector.take, client_module.encode_requests = noting_take, noting_encode
    log = Path(tempfile.mkdtemp()) / "timeline.jsonl"
    log.touch()
    results = {}
    with ServerProcess(paths.maps_dir(), 2, code=SERVER_NOTES, env={"KVFERRY_TIMELINE": str(log)},
                       map_threads=a.map_threads) as sc, \
            TranslateClient(ClientOptions(target=sc.address, timeout=300, chunk_tokens=a.chunk_tokens)) as client:
        for n in a.sizes:
            ids = long_ids(target.tokenizer, n)
            with torch.no_grad():
                src = capture_kv(source.model, ids[:, : n - 16])
            kw = dict(source_geometry=source.identity.geometry.fingerprint, tokenizer=source.identity.tokenizer)
            client.translate(src, ms.name, ms.version, **kw)  # warm-up
            calls = timed_calls(lambda: client.translate(src, ms.name, ms.version, **kw), log, marks, a.reps)
            per = [phases(c) for c in calls]
            med = {k: statistics.median(p[k] for p in per) for k in per[0]}
            calls.sort(key=lambda c: c[-1][1])
            results[n] = {"phase_medians_ms": med, "median_call": calls[len(calls) // 2]}
            print(f"n={n}: " + " | ".join(f"{k} {v:.2f}" for k, v in med.items()) + " ms", flush=True)
            print("   median call: " + "  ".join(f"{name}@{t:.1f}" for name, t in calls[len(calls) // 2]), flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
