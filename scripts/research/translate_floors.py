"""Issue 16: is the translate RPC's serial bound (echo + in-process map) a fair one? The echo streams each request
message back as it arrives, so it could overlap the upload with the download where a translation cannot (every
target layer of the tiny map reads the last source layer). This times, side by side in rounds on one sidecar
process, the translate RPC, the echo, the upload alone (a client stream the server only counts: Sink) and the
download alone (Replay of the response's message sizes). Tiny family's S__T map.

    .venv/bin/python scripts/research/translate_floors.py --sizes 2048 8192 --reps 15 --json runs/results/translate_floors.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from kvferry import paths
from kvferry.bench.harness import ServerProcess, long_ids, round_robin_ms, tiny_pair, write_json
from kvferry.client.client import ClientOptions, TranslateClient, chunk_tokens_for, encode_requests, make_spec
from kvferry.mappings.capture import capture_kv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    ms, source, target = tiny_pair()
    results = {}
    with ServerProcess(paths.maps_dir()) as server, TranslateClient(ClientOptions(target=server.address, timeout=300)) as client:
        for n in a.sizes:
            ids = long_ids(target.tokenizer, n)
            with torch.no_grad():
                src = capture_kv(source.model, ids[:, : n - 16])
            kw = dict(source_geometry=source.identity.geometry.fingerprint, tokenizer=source.identity.tokenizer)
            payloads = [m.SerializeToString() for m in encode_requests(make_spec(src, ms.name, ms.version, **kw), src,
                                                                      chunk_tokens_for(client.options, src))]
            res = client.translate(src, ms.name, ms.version, **kw)
            out_sizes = [2 * b.key.numel() * b.key.element_size() for b in res.blocks]
            assert server.sink(payloads) == sum(map(len, payloads))
            calls = {"translate_rpc": lambda: client.translate(src, ms.name, ms.version, **kw),
                     "echo": lambda: server.roundtrip(payloads), "upload": lambda: server.sink(payloads),
                     "download": lambda: server.replay(out_sizes)}
            times = round_robin_ms(calls, a.reps)
            med = {k: statistics.median(v) for k, v in times.items()}
            med["upload+download"] = med["upload"] + med["download"]
            results[n] = {"median_ms": med, "request_bytes": sum(map(len, payloads)), "response_bytes": sum(out_sizes), "reps": a.reps}
            print(f"n={n}: " + " | ".join(f"{k} {v:.1f}" for k, v in med.items()) + f" ms (medians of {a.reps}, rounds)", flush=True)
    write_json(a.json, results)


if __name__ == "__main__":
    main()
