"""``kvferry bench load``: a bounded load generator on loopback against a sidecar in its own process.

``--clients`` asyncio clients each run ``--requests`` translates of ``--tokens`` tokens of random source
KV (the map does not care what the numbers are). Reports throughput, p50/p99 latency, errors by status
code, and the server's resident memory: its peak (VmHWM) and its RSS after each quarter of the run, which
shows whether memory grows with the request count or stays within the bound set by concurrent streams.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import time
from pathlib import Path

from kvferry import paths
from kvferry.bench.refused import add_flag, banner, bench_map


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in bytes (Linux /proc)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


async def _drive(address: str, a: argparse.Namespace, ms, pid: int) -> dict:
    import grpc
    import torch

    from kvferry.client.client import AsyncTranslateClient, ClientOptions, Retry

    sg = ms.source.geometry
    g = torch.Generator().manual_seed(0)
    kv = [
        tuple(torch.randn(1, sg.kv_heads, a.tokens, sg.head_dim, generator=g) for _ in range(2))
        for _ in range(sg.layers)
    ]
    kw = dict(source_geometry=sg.fingerprint, tokenizer=ms.source.tokenizer)
    total = a.clients * a.requests
    latencies: list[float] = []
    errors: collections.Counter = collections.Counter()
    checkpoints: list[dict] = []
    done = 0
    opts = ClientOptions(target=address, timeout=a.timeout, chunk_tokens=a.chunk_tokens, retry=Retry(retries=a.retries))

    async def client(c: AsyncTranslateClient) -> None:
        nonlocal done
        for _ in range(a.requests):
            t0 = time.perf_counter()
            try:
                res = await c.translate(kv, ms.name, ms.version, **kw)
                if res.stats.tokens != a.tokens:
                    errors["WRONG_RESULT"] += 1
                else:
                    latencies.append(time.perf_counter() - t0)
            except grpc.RpcError as e:
                errors[e.code().name] += 1
            done += 1
            if done * 4 // total > len(checkpoints):
                checkpoints.append({"requests": done, **proc_memory(pid)})

    clients = [AsyncTranslateClient(opts) for _ in range(a.clients)]
    try:
        await clients[0].translate(kv, ms.name, ms.version, **kw)  # warm-up
        base = proc_memory(pid)
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in clients))
        wall = time.perf_counter() - t0
    finally:
        for c in clients:
            await c.close()
    lat = sorted(latencies)

    def pick(q):
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 if lat else float("nan")

    return {
        "clients": a.clients,
        "requests_per_client": a.requests,
        "tokens": a.tokens,
        "completed": len(lat),
        "errors": dict(errors),
        "wall_s": wall,
        "translates_per_s": len(lat) / wall,
        "tokens_per_s": len(lat) * a.tokens / wall,
        "p50_ms": pick(0.5),
        "p99_ms": pick(0.99),
        "mean_ms": statistics.fmean(lat) * 1e3 if lat else float("nan"),
        "server_rss_after_warmup": base["VmRSS"],
        "server_rss_by_quarter": checkpoints,
        "server_peak_rss": proc_memory(pid)["VmHWM"],
    }


def run(a: argparse.Namespace) -> int:
    from .harness import ServerProcess

    ms, served = bench_map(a.maps_dir, a.map, a.version, a.serve_refused_maps)
    with ServerProcess(
        a.maps_dir, a.threads or 0, max_streams=a.max_streams, serve_refused_maps=served is not None
    ) as server:
        row = asyncio.run(_drive(server.address, a, ms, server.proc.pid))
    row.update(map=ms.name, version=ms.version, max_streams=a.max_streams, refused_map_served=served)
    mib = 1 << 20
    quarters = ", ".join(f"{c['VmRSS'] / mib:.0f}" for c in row["server_rss_by_quarter"])
    lines = [
        *([banner(served), ""] if served else []),
        f"map {ms.name} {ms.version}; {a.clients} clients x {a.requests} translates of {a.tokens} tokens; "
        f"server max_streams {a.max_streams}",
        "",
        "| completed | errors | wall s | translates/s | p50 ms | p99 ms | server RSS after warm-up MiB | "
        "RSS after each quarter MiB | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {row['completed']} | {row['errors'] or 0} | {row['wall_s']:.1f} | {row['translates_per_s']:.1f} | "
        f"{row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {row['server_rss_after_warmup'] / mib:.0f} | {quarters} | "
        f"{row['server_peak_rss'] / mib:.0f} |",
    ]
    print("\n".join(lines))
    if a.json:
        Path(a.json).write_text(json.dumps(row, indent=1) + "\n")
    return 0 if not row["errors"] else 1


def add_parser(sub) -> None:
    b = sub.add_parser("load", help="concurrent translates against a sidecar: throughput, latency, errors, server RSS")
    b.add_argument("--maps-dir", type=Path, default=paths.maps_dir())
    b.add_argument("--map", default="S__T")
    b.add_argument("--version", default="")
    add_flag(b)
    b.add_argument("--clients", type=int, default=32)
    b.add_argument("--requests", type=int, default=200, help="translates per client")
    b.add_argument("--tokens", type=int, default=2048)
    b.add_argument("--chunk-tokens", type=int, default=2048)
    b.add_argument("--max-streams", type=int, default=64, help="the sidecar's stream cap")
    b.add_argument("--retries", type=int, default=3)
    b.add_argument("--timeout", type=float, default=120.0)
    b.add_argument("--threads", type=int, default=None, help="torch threads in the sidecar")
    b.add_argument("--json", default=None)
    b.set_defaults(func=run)
