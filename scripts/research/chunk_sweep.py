"""Issue 16: Translate RPC time against the client's source chunk size, one sidecar, sizes called in turn.

Smaller chunks let the sidecar map while the upload goes on; each message also costs the event loop a read, a
copy and a hand-off to the compute thread. Per chunk size: the RPC median, the sidecar's compute (e), the echo of
the same request bytes (d), and the in-process map (c) once, so bound/RPC = ((c) + (d)) / RPC reads per size.

    .venv/bin/python scripts/research/chunk_sweep.py --source models/S --target models/T --sizes 2048 8192 \
        --chunks 512 2048 8192 --json runs/results/chunk_sweep.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sidecar_pair import load_pair, pair_arguments  # scripts/research/sidecar_pair.py (beside this script)
from kvferry.bench.harness import ServerProcess, long_ids, median_seconds
from kvferry.client.client import ClientOptions, TranslateClient, encode_requests, make_spec
from kvferry.mappings.apply import apply
from kvferry.mappings.capture import capture_kv


def main() -> None:
    ap = argparse.ArgumentParser()
    pair_arguments(ap, reps=7)
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    source, target, ms, kw = load_pair(a)
    rows = []
    with ServerProcess(a.maps_dir, a.threads) as server:
        clients = {c: TranslateClient(ClientOptions(target=server.address, chunk_tokens=c, timeout=300)) for c in a.chunks}
        for n in a.sizes:
            with torch.no_grad():
                src = capture_kv(source.model, long_ids(target.tokenizer, n)[:, : n - 16])
            t_apply = median_seconds(lambda: apply(ms, src, 0), a.reps) * 1e3
            payloads = {c: [m.SerializeToString() for m in encode_requests(make_spec(src, ms.name, ms.version, **kw), src, c)]
                        for c in a.chunks}
            times = {c: [] for c in a.chunks}
            compute = {c: [] for c in a.chunks}
            echo = {c: [] for c in a.chunks}
            for c in a.chunks:  # warm-up
                clients[c].translate(src, ms.name, ms.version, **kw)
            for _ in range(a.reps):
                for c in a.chunks:
                    t = time.perf_counter()
                    res = clients[c].translate(src, ms.name, ms.version, **kw)
                    times[c].append((time.perf_counter() - t) * 1e3)
                    compute[c].append(res.stats.compute_seconds * 1e3)
                    t = time.perf_counter()
                    server.roundtrip(payloads[c])
                    echo[c].append((time.perf_counter() - t) * 1e3)
            for c in a.chunks:
                rpc, d = statistics.median(times[c]), statistics.median(echo[c])
                rows.append({"n": n, "chunk_tokens": c, "messages_in": len(payloads[c]), "rpc_ms": rpc,
                             "sidecar_compute_ms": statistics.median(compute[c]), "echo_ms": d, "apply_ms": t_apply,
                             "bound_vs_rpc": (t_apply + d) / rpc})
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
        for c in clients.values():
            c.close()
    print(f"\nmap {ms.name} {ms.version}; medians of {a.reps}, chunk sizes called in turn on one sidecar\n")
    print("| n | chunk tokens | request messages | RPC ms | (e) compute ms | (d) echo ms | (c) apply ms | bound/RPC |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['chunk_tokens']} | {r['messages_in']} | {r['rpc_ms']:.1f} | {r['sidecar_compute_ms']:.1f} | "
              f"{r['echo_ms']:.1f} | {r['apply_ms']:.1f} | {r['bound_vs_rpc']:.2f} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"map": ms.name, "version": ms.version, "reps": a.reps, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
