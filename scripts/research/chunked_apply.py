"""Issue 16, session 17: the map's work in one process, with no transfer: the whole-cache ``apply`` against the
sidecar's own path over the same source chunks the client would send (decoded frames, the NaN/Inf check, the session's
streaming map, the blocks' encoding), each part timed. The gap between this and the sidecar's RPC is the transfer and
its contention, not the map:

    .venv/bin/python scripts/research/chunked_apply.py --source models/pretrained/smollm2-135m-l25 \\
        --target models/pretrained/smollm2-135m --sizes 2048 8192 --reps 3 --json runs/results/chunked_apply.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sidecar_pair import load_pair, pair_arguments  # scripts/research/sidecar_pair.py (beside this script)
from kvferry.bench.harness import long_ids
from kvferry.client.client import ClientOptions, chunk_tokens_for, encode_requests, make_spec
from kvferry.common import wire
from kvferry.common.messages import TranslateSpec
from kvferry.mappings.apply import apply
from kvferry.mappings.capture import capture_kv
from kvferry.sidecar.limits import Limits
from kvferry.sidecar.pipeline import TranslateSession, all_finite


def main() -> None:
    ap = argparse.ArgumentParser()
    pair_arguments(ap, reps=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    source, target, ms, _ = load_pair(a)
    rows = []
    for n in a.sizes:
        with torch.no_grad():
            src = capture_kv(source.model, long_ids(target.tokenizer, n + 16)[:, :n])
        tokens = chunk_tokens_for(ClientOptions(), src)
        frames = [wire.decode_request(m) for m in list(encode_requests(make_spec(src, ms.name, ms.version), src, tokens, encoded=True))[1:]]
        parts = {"check": 0.0, "map": 0.0, "encode": 0.0}

        def chunked():
            session = TranslateSession(TranslateSpec(map_name=ms.name, map_version=ms.version, num_tokens=n), ms, Limits())
            for f in frames:
                chunk = wire.chunk_from_frame(f, session.expected_shape(f.end - f.start), torch.float32)
                t0 = time.perf_counter()
                all_finite(chunk.tensor)
                t1 = time.perf_counter()
                blocks = session.add(chunk)
                t2 = time.perf_counter()
                for b in blocks:
                    wire.encode_block_response(b)
                t3 = time.perf_counter()
                parts["check"] += t1 - t0
                parts["map"] += t2 - t1
                parts["encode"] += t3 - t2

        row = {"n": n, "chunk_tokens": tokens, "chunks": len(frames)}
        for name, fn in (("apply_ms", lambda: apply(ms, src, 0)), ("chunked_ms", chunked)):
            fn()  # warm-up
            times = []
            for _ in range(a.reps):
                for k in parts:
                    parts[k] = 0.0
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            row[name] = statistics.median(times)
        row.update({f"chunked_{k}_ms": v * 1e3 for k, v in parts.items()})  # of the last chunked run
        rows.append(row)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"map": ms.name, "version": ms.version, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
