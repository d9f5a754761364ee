"""Issue 16, session 15: per-call costs on the hit path that scale with the prompt, each timed side by side with the
code it replaced (medians of --reps calls, in one process):

  read_block      verifying one stored 6-layer block (3 kv heads x 256 tokens x 32, bf16): the header parsed each time
                  (its verified-header memo cleared before each call) against the memo of verified headers
  header ids      a TranslateHeader's 8k token ids as a tuple: tuple() over protobuf's field against numpy's one read
  client ids      make_spec's ids from a list of 8k ints: an int() per id against the C-speed type check
  message length  the length prefix of a hit's 8192-token message (93 pieces per tensor): a generator against map()

    .venv/bin/python scripts/research/small_costs.py --json runs/results/small_costs.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvferry.bench.harness import median_seconds, write_json
from kvferry.client.client import _token_ids
from kvferry.common import prefix, wire
from kvferry.common.prefix import encode_block, read_block
from kvferry.v1 import translate_pb2 as pb


def median_us(fn, reps: int) -> float:
    return median_seconds(fn, reps) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2001)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    layers = [tuple(torch.randn(3, 256, 32, generator=g).to(torch.bfloat16) for _ in range(2)) for _ in range(6)]
    h = bytes(range(32))
    blob = encode_block(layers, h, 256)

    def parsed_each_time():
        prefix._VERIFIED_HEADERS.clear()
        read_block(blob, h, 6, (3, 256, 32))

    ids = list(range(1000, 1000 + 8192))
    header = pb.TranslateHeader(token_ids=ids)
    pieces = [memoryview(bytes(512))] * 93
    rows = {
        "read_block": (median_us(parsed_each_time, a.reps), median_us(lambda: read_block(blob, h, 6, (3, 256, 32)), a.reps)),
        "header ids": (median_us(lambda: tuple(header.token_ids), a.reps), median_us(lambda: wire._token_ids(header.token_ids), a.reps)),
        "client ids": (median_us(lambda: tuple(map(int, ids)), a.reps), median_us(lambda: _token_ids(ids), a.reps)),
        "message length": (median_us(lambda: sum(len(p) for p in pieces), a.reps), median_us(lambda: sum(map(len, pieces)), a.reps)),
    }
    assert wire._token_ids(header.token_ids) == tuple(ids) == _token_ids(ids)
    print("| what | before us | now us |\n|---|---|---|")
    for what, (before, now) in rows.items():
        print(f"| {what} | {before:.1f} | {now:.1f} |")
    write_json(a.json, {w: {"before_us": b, "now_us": n} for w, (b, n) in rows.items()})


if __name__ == "__main__":
    main()
