"""Issue 16: is the sidecar's slower map (e) the session's code path, or the sidecar's process and threads?

Replays, in one process and on the main thread, exactly what the sidecar does with a Translate request's bytes:
decode each message (`wire.decode_request`), check and view the chunk, `TranslateSession.add`, encode the blocks.
Side by side, interleaved, medians:
  apply          `apply(ms, src)`, as `kvferry bench translate` times (c)
  session        the replay's session.add total (the sidecar's compute_seconds covers the same code)
  session+encode the same plus decoding the requests and encoding the response blocks (all the sidecar's work on
                 the bytes but the transport)

    .venv/bin/python scripts/research/session_replay.py --source models/S --target models/T --sizes 2048 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from sidecar_pair import load_pair, pair_arguments  # scripts/research/sidecar_pair.py (beside this script)
from kvferry.bench.harness import long_ids
from kvferry.client.client import encode_requests, make_spec
from kvferry.common import wire
from kvferry.mappings.apply import apply
from kvferry.mappings.capture import capture_kv
from kvferry.sidecar.limits import Limits
from kvferry.sidecar.pipeline import TranslateSession


def replay(payloads: list[bytes], ms, limits: Limits) -> tuple[float, float]:
    """(session.add seconds, total seconds) for one request's messages."""
    t0 = time.perf_counter()
    first = wire.decode_request(payloads[0])
    session = TranslateSession(wire.spec_from_pb(first.header), ms, limits)
    out = [wire.encode_block_response(b) for b in session.initial_blocks()]
    for data in payloads[1:]:
        req = wire.decode_request(data)
        session.check_chunk_header(req.layer, wire.chunk_kind(req), req.start, req.end)
        chunk = wire.chunk_from_frame(req, session.expected_shape(req.end - req.start), session.spec.source_dtype)
        out += [wire.encode_block_response(b) for b in session.add(chunk)]
    session.finish()
    return session.stats.compute_seconds, time.perf_counter() - t0


def timed_apply(ms, src) -> float:
    t = time.perf_counter()
    apply(ms, src, 0)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    pair_arguments(ap, reps=9)
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--worker", action="store_true", help="everything (apply too) on one long-lived worker thread, as the sidecar maps")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    source, target, ms, kw = load_pair(a)
    limits = Limits()
    rows = []
    pool = ThreadPoolExecutor(max_workers=1) if a.worker else None
    for n in a.sizes:
        with torch.no_grad():
            src = capture_kv(source.model, long_ids(target.tokenizer, n)[:, : n - 16])
        payloads = [m.SerializeToString() for m in encode_requests(make_spec(src, ms.name, ms.version, **kw), src, a.chunk_tokens)]
        samples = {"apply": [], "session": [], "session+encode": []}
        for rep in range(a.reps + 1):
            run = (lambda f, *x: pool.submit(f, *x).result()) if pool else (lambda f, *x: f(*x))
            dt_apply = run(timed_apply, ms, src)
            dt_session, dt_total = run(replay, payloads, ms, limits)
            if rep:  # the first round warms up
                for k, v in (("apply", dt_apply), ("session", dt_session), ("session+encode", dt_total)):
                    samples[k].append(v * 1e3)
        row = {"n": n} | {f"{k}_ms": statistics.median(v) for k, v in samples.items()}
        rows.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    print(f"\nmap {ms.name} {ms.version}; medians of {a.reps}; chunks of {a.chunk_tokens} tokens; {'one worker thread' if pool else 'main thread'}, one process\n")
    print("| n | apply ms (c) | session.add ms | session + decode + encode ms |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['apply_ms']:.1f} | {r['session_ms']:.1f} | {r['session+encode_ms']:.1f} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"map": ms.name, "version": ms.version, "reps": a.reps, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
