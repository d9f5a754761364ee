"""Would a shared-memory data plane beat gRPC's transfer on this machine? The one-way transport floors, side by side.

A sidecar beside its model server in one pod (the chart's podSidecar mode) could hand a response's tensor bytes over
in a memory region both containers map, and send only their offsets over gRPC. Before building that, this times what
such a transfer costs against gRPC's own floor for the same bytes, in turn within each round, one server process:

  grpc          Replay: messages of the sizes asked, streamed from the server's memory (the benches' floor).
  shm_fresh     the client creates a region (a file on /dev/shm, ftruncated, mapped); the server opens it by name,
                unlinks it and writes every payload into it with pwrite, then answers one small message per payload;
                the client then reads every page of its mapping (a result would view it: no copy).
  shm_reused    one region per client, made once and kept mapped by both sides: the server copies into its mapping,
                the client copies the bytes out into fresh memory (a result must own its bytes: the next call
                reuses the region).

    python scripts/research/shm_floor.py --mib 4 9 17 36 --messages 6 --reps 31 --json runs/results/shm_floor.json
"""

from __future__ import annotations

import argparse
import mmap
import os
import secrets
import statistics
import struct
import subprocess
import sys

import grpc
import numpy as np

from kvferry.bench.harness import paired_ratio, round_robin_ms, write_json

SERVER = r'''
import asyncio, mmap, os, struct, sys
import grpc

payloads, regions = {}, {}

def built(sizes):
    key = tuple(sizes)
    if key not in payloads:
        payloads[key] = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    return payloads[key]

def parse(request):
    n = struct.unpack_from("<I", request)[0]
    sizes = struct.unpack_from(f"<{n}I", request, 4)
    return sizes, request[4 + 4 * n:].decode()

async def replay(request, context):
    for p in built(struct.unpack(f"<{len(request) // 4}I", request)):
        yield p

async def shm_fresh(request, context):
    sizes, name = parse(request)
    fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW)
    os.unlink(name)  # one use: the name is gone once the server holds the file
    try:
        off = 0
        for p in built(sizes):
            os.pwrite(fd, p, off)
            yield struct.pack("<QQ", off, len(p))
            off += len(p)
    finally:
        os.close(fd)

async def shm_reused(request, context):
    sizes, name = parse(request)
    if name not in regions:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW)
        regions[name] = mmap.mmap(fd, os.fstat(fd).st_size)
        os.close(fd)
    m, off = regions[name], 0
    for p in built(sizes):
        m[off:off + len(p)] = p
        yield struct.pack("<QQ", off, len(p))
        off += len(p)

async def main():
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe.Shm", {
        "Replay": grpc.unary_stream_rpc_method_handler(replay),
        "Fresh": grpc.unary_stream_rpc_method_handler(shm_fresh),
        "Reused": grpc.unary_stream_rpc_method_handler(shm_reused)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, nargs="+", default=[4, 9, 17, 36])
    ap.add_argument("--messages", type=int, default=6)
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    address = proc.stdout.readline().split()[-1]
    from kvferry.client.client import SINGLE_THREADED_STREAMS

    channel = grpc.insecure_channel(address, [("grpc.max_receive_message_length", 64 << 20), SINGLE_THREADED_STREAMS])
    calls = {m: channel.unary_stream(f"/probe.Shm/{m}") for m in ("Replay", "Fresh", "Reused")}
    reused_name = os.path.join(a.shm_dir, "kvf-probe-" + secrets.token_hex(8))
    results = []
    try:
        for mib in a.mib:
            each = int(mib * 2**20) // a.messages
            sizes = [each] * a.messages
            total = sum(sizes)
            replay_req = struct.pack(f"<{len(sizes)}I", *sizes)
            shm_req = struct.pack("<I", len(sizes)) + replay_req  # then the region's name
            fd = os.open(reused_name, os.O_CREAT | os.O_RDWR, 0o600)
            os.ftruncate(fd, total)
            reused = mmap.mmap(fd, total)
            os.close(fd)

            def grpc_floor():
                assert sum(len(r) for r in calls["Replay"](replay_req, timeout=60)) == total

            def shm_fresh():
                name = os.path.join(a.shm_dir, "kvf-probe-" + secrets.token_hex(16))
                fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.ftruncate(fd, total)
                    region = mmap.mmap(fd, total)
                finally:
                    os.close(fd)
                spans = [struct.unpack("<QQ", r) for r in calls["Fresh"](shm_req + name.encode(), timeout=60)]
                view = np.frombuffer(region, dtype=np.uint8)
                assert int(view[:: mmap.PAGESIZE].sum()) >= 0 and sum(n for _, n in spans) == total  # every page read
                del view
                region.close()

            def shm_reused():
                spans = [struct.unpack("<QQ", r) for r in calls["Reused"](shm_req + reused_name.encode(), timeout=60)]
                view = np.frombuffer(reused, dtype=np.uint8)
                owned = [view[o:o + n].copy() for o, n in spans]
                assert sum(x.nbytes for x in owned) == total
                del view

            times = round_robin_ms({"grpc": grpc_floor, "shm_fresh": shm_fresh, "shm_reused": shm_reused}, a.reps)
            row = {"MiB": total / 2**20, "messages": len(sizes), **{f"{k}_ms": statistics.median(v) for k, v in times.items()},
                   "fresh_over_grpc": paired_ratio(times, ("shm_fresh",), ("grpc",)),
                   "reused_over_grpc": paired_ratio(times, ("shm_reused",), ("grpc",))}
            results.append(row)
            print(f"{row['MiB']:.1f} MiB in {len(sizes)}: gRPC {row['grpc_ms']:.2f} ms, shm fresh {row['shm_fresh_ms']:.2f} ms "
                  f"({row['fresh_over_grpc']['median']:.2f}x per round), shm reused + copy out {row['shm_reused_ms']:.2f} ms "
                  f"({row['reused_over_grpc']['median']:.2f}x)", flush=True)
            reused.close()
            os.unlink(reused_name)
            reused_name = os.path.join(a.shm_dir, "kvf-probe-" + secrets.token_hex(8))
    finally:
        channel.close()
        proc.terminate()
        proc.wait(10)
        if os.path.exists(reused_name):
            os.unlink(reused_name)
    write_json(a.json, {"args": vars(a), "rows": results})


if __name__ == "__main__":
    main()
