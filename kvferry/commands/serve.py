"""`kvferry serve`: the gRPC translation sidecar."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from kvferry.sidecar.config import add_arguments  # its flags are SidecarConfig's fields

    s = sub.add_parser("serve", help="run the gRPC translation sidecar")
    add_arguments(s)
    s.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    import asyncio
    import logging

    from kvferry.sidecar.config import from_sources
    from kvferry.sidecar.memory import tune_allocator
    from kvferry.sidecar.server import serve

    tune_allocator()  # before gRPC allocates: see kvferry.sidecar.memory
    config = from_sources(a)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))
    return 0
