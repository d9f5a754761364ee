"""Issue 16, session 15: per-call costs on the hit path that scale with the prompt, each timed side by side with the
code it replaced (medians of --reps calls, in one process):

  read_block      verifying one stored 6-layer block (3 kv heads x 256 tokens x 32, bf16): the header parsed each time
                  (its verified-header memo cleared before each call) against the memo of verified headers
  header ids      a TranslateHeader's 8k token ids as a tuple: tuple() over protobuf's field against numpy's one read
  client ids      make_spec's ids from a list of 8k ints: an int() per id against the C-speed type check
  message length  the length prefix of a hit's 8192-token message (93 pieces per tensor): a generator against map()
  hit pieces      (session 18) every layer's K and V of a 31-block hit as stored-byte pieces (what a sidecar hit sends):
                  the spans found block by block with per-block shapes (Lookup.pieces through session 17) against
                  the blocks overlapping the range indexed directly, in the one shape a lookup reads
  block views     (session 18) one stored block's 6 layers as tensors viewing its bytes: a view per tensor
                  (StoredBlock.layer) against one view of the payload split in one call (StoredBlock.layers)
  cast join       (session 18) a 31-block bf16 hit joined per layer as float32: joined, then each layer cast (through
                  session 17) against the cast done while joining, a block at a time (Lookup._join_cast)
  chunk encode    (session 19) one source chunk as the client sends it: 2,730 of 8,192 tokens of an l25 layer's K
                  ([3, 2730, 64] fp32, a view): copied into bytes and then joined into the message (through session
                  18) against the join straight from each head's contiguous slice (wire._tensor_pieces)

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
from kvferry.common.messages import Chunk
from kvferry.common.prefix_cache import Lookup
from kvferry.v1 import translate_pb2 as pb


def median_us(fn, reps: int) -> float:
    return median_seconds(fn, reps) * 1e6


def pieces_before(look: Lookup, layer: int, kind: int, start: int, stop: int) -> list[memoryview]:
    """Lookup.pieces as it was through session 17."""
    spans, at = [], 0
    for b in look.blocks:
        heads, n, _ = b.shape
        row = b.row_bytes
        lo, hi = max(start - at, 0), min(stop - at, n)
        if lo < hi:
            spans.append((b.data, b.offsets[layer][kind] + lo * row, (hi - lo) * row, n * row))
        at += n
    return [data[base + h * stride : base + h * stride + size] for h in range(heads if spans else 0)
            for data, base, size, stride in spans]


def chunk_before(c: Chunk) -> bytes:
    """wire.encode_chunk_request as it was through session 18: a tensor not contiguous as a whole copied to bytes first."""
    data = wire.tensor_bytes(c.tensor)
    tensor = wire._data_fields(c.tensor.dtype, c.tensor.shape, [data], len(data))
    body = (wire._scalar(1, c.layer) + wire._scalar(2, wire.KIND_TO_PB[c.kind]) + wire._scalar(3, c.start)
            + wire._scalar(4, c.end) + wire._length_delimited(5, tensor))
    return b"".join(wire._length_delimited(2, body))


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
    hashes = [bytes([j]) * 32 for j in range(31)]
    look = Lookup(hashes, 0, [read_block(encode_block(layers, hj, 256), hj, 6, (3, 256, 32)) for hj in hashes])
    n = look.tokens
    hit_pieces = lambda get: [get(t, kind, 0, n) for t in range(6) for kind in (0, 1)]  # noqa: E731
    block = look.blocks[0]
    as_f32 = Lookup(hashes, 0, look.blocks, dtype=torch.float32)
    chunk = Chunk(3, "k", 2730, 5460, torch.randn(3, 8192, 64, generator=g)[:, 2730:5460])
    rows = {
        "read_block": (median_us(parsed_each_time, a.reps), median_us(lambda: read_block(blob, h, 6, (3, 256, 32)), a.reps)),
        "header ids": (median_us(lambda: tuple(header.token_ids), a.reps), median_us(lambda: wire._token_ids(header.token_ids), a.reps)),
        "client ids": (median_us(lambda: tuple(map(int, ids)), a.reps), median_us(lambda: _token_ids(ids), a.reps)),
        "message length": (median_us(lambda: sum(len(p) for p in pieces), a.reps), median_us(lambda: sum(map(len, pieces)), a.reps)),
        "hit pieces": (median_us(lambda: hit_pieces(lambda *r: pieces_before(look, *r)), a.reps), median_us(lambda: hit_pieces(look.pieces), a.reps)),
        "block views": (median_us(lambda: [block.layer(i) for i in range(6)], a.reps), median_us(block.layers, a.reps)),
        "cast join": (median_us(lambda: [(k.to(torch.float32), v.to(torch.float32)) for k, v in look._join_uniform()], a.reps // 10),
                      median_us(as_f32.layers, a.reps // 10)),
        "chunk encode": (median_us(lambda: chunk_before(chunk), a.reps // 10), median_us(lambda: wire.encode_chunk_request(chunk), a.reps // 10)),
    }
    assert chunk_before(chunk) == wire.encode_chunk_request(chunk) == wire.chunk_to_pb(chunk).SerializeToString()
    assert all(torch.equal(x.float(), y) for pair, want in zip(look.layers(), as_f32.layers()) for x, y in zip(pair, want))
    for r in [(0, 0, 0, n), (3, 1, 5, 300), (5, 0, 256, 512), (1, 1, n - 1, n), (2, 0, 700, 7000)]:
        assert [bytes(p) for p in pieces_before(look, *r)] == [bytes(p) for p in look.pieces(*r)], r
    assert all(torch.equal(x, y) for pair, want in zip(block.layers(), [block.layer(i) for i in range(6)]) for x, y in zip(pair, want))
    assert wire._token_ids(header.token_ids) == tuple(ids) == _token_ids(ids)
    print("| what | before us | now us |\n|---|---|---|")
    for what, (before, now) in rows.items():
        print(f"| {what} | {before:.1f} | {now:.1f} |")
    write_json(a.json, {w: {"before_us": b, "now_us": n} for w, (b, n) in rows.items()})


if __name__ == "__main__":
    main()
