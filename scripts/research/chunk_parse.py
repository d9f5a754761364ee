"""Issue 16 lever, side by side in one process: the sidecar's parse of one source chunk, protobuf
(TranslateRequest.FromString, then one read of the data field: two copies of the tensor bytes) against
wire.decode_request (the canonical chunk read in place: the tensor views the received bytes).

    .venv/bin/python scripts/research/chunk_parse.py --json runs/results/chunk_parse.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvferry.bench.harness import median_seconds
from kvferry.common import wire
from kvferry.common.messages import Chunk
from kvferry.v1 import translate_pb2 as pb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=3, help="source kv heads (SmolLM2: 3)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--reps", type=int, default=201)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in a.tokens:
            shape = (a.heads, n, a.head_dim)
            data = wire.encode_chunk_request(Chunk(0, "k", 0, n, torch.randn(shape).to(dtype)))

            def protobuf():
                return wire.chunk_from_pb(pb.TranslateRequest.FromString(data).chunk, shape, dtype)

            def in_place():
                return wire.chunk_from_frame(wire.decode_request(data), shape, dtype)

            assert torch.equal(protobuf().tensor, in_place().tensor)
            pb_ms, ip_ms = median_seconds(protobuf, a.reps) * 1e3, median_seconds(in_place, a.reps) * 1e3
            rows.append({"dtype": wire.dtype_name(dtype), "tokens": n, "bytes": len(data), "protobuf_ms": pb_ms,
                         "in_place_ms": ip_ms, "protobuf_GiB_s": len(data) / pb_ms / 1e-3 / 2**30})
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    print("\n| dtype | tokens | chunk bytes | protobuf parse + data read ms | read in place ms |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['tokens']} | {r['bytes']} | {r['protobuf_ms']:.3f} | {r['in_place_ms']:.3f} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"reps": a.reps, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
