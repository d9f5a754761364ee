"""A sidecar plus a raw-bytes echo service in one process, for benchmarks that must not share the
client's interpreter (and GIL). Prints "listening on HOST:PORT" once serving.

    python -m kvferry.bench.server --maps-dir maps [--redis-url …] [--prefix-secret …]
"""

from __future__ import annotations

import argparse
import asyncio
import struct

import grpc

from kvferry.bench.refused import add_flag
from kvferry.sidecar.config import SidecarConfig
from kvferry.sidecar.server import Sidecar

ECHO_METHOD = "/kvferry.bench.Echo/Echo"
REPLAY_METHOD = "/kvferry.bench.Echo/Replay"
SINK_METHOD = "/kvferry.bench.Echo/Sink"


def echo_handler():
    async def echo(request_iterator, context):
        async for raw in request_iterator:
            yield raw

    payloads: dict[bytes, list[bytes]] = {}

    async def replay(request: bytes, context):
        """Stream back messages of the sizes asked (little-endian uint32s): gRPC's one-way transport floor."""
        if request not in payloads:
            sizes = struct.unpack(f"<{len(request) // 4}I", request)
            payloads[request] = [bytes([i % 251]) * n for i, n in enumerate(sizes)]  # distinct buffers, as real ones
        for p in payloads[request]:
            yield p

    async def sink(request_iterator, context):
        """Take the messages sent and answer their total size: gRPC's one-way transport floor, client to server."""
        total = 0
        async for raw in request_iterator:
            total += len(raw)
        return struct.pack("<Q", total)

    return grpc.method_handlers_generic_handler(
        "kvferry.bench.Echo",
        {
            "Echo": grpc.stream_stream_rpc_method_handler(echo),
            "Replay": grpc.unary_stream_rpc_method_handler(replay),
            "Sink": grpc.stream_unary_rpc_method_handler(sink),
        },
    )


async def _main(a: argparse.Namespace) -> None:
    cfg = SidecarConfig(
        maps_dir=a.maps_dir,
        port=0,
        reload_seconds=0,
        force_maps=a.serve_refused_maps,
        redis_url=a.redis_url,
        prefix_secret=a.prefix_secret,
        prefix_block_size=a.prefix_block_size,
        threads=a.threads,
        max_streams=a.max_streams,
        map_threads=a.map_threads,
        shm_dir=a.shm_dir,
    )
    sc = Sidecar(cfg, extra_handlers=(echo_handler(),))
    port = await sc.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await sc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--maps-dir", required=True)
    ap.add_argument("--redis-url", default="")
    ap.add_argument("--prefix-secret", default="")
    ap.add_argument("--prefix-block-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--map-threads", type=int, default=0)
    ap.add_argument("--max-streams", type=int, default=64)
    ap.add_argument("--shm-dir", default="", help="the sidecar's shm_dir (response regions)")
    add_flag(ap)
    asyncio.run(_main(ap.parse_args()))


if __name__ == "__main__":
    main()
