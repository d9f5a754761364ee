"""The ``kvferry`` command. Every subcommand lives in its own module under kvferry.commands and registers itself
there (``add_parser``), the benchmarks under ``kvferry bench`` likewise in kvferry.bench:

- the offline lab: ``fit``, ``distill``, ``match-values``, ``eval``, ``frontier``;
- artifacts and models: ``maps inspect``, ``maps fetch``, ``models fetch|cut|path``;
- serving: ``serve``, ``health``, ``rollout``, ``shm-folder``;
- ``bench ...``, ``demo``, and ``family`` (builds the shipped tiny family).

Building the parser imports no torch, gRPC or transformers (``kvferry --help`` stays fast); each command imports
what it needs when it runs.
"""

from __future__ import annotations

import argparse
import sys

from kvferry.commands import (
    bench,
    demo,
    distill,
    evaluate,
    family,
    fit,
    frontier,
    health,
    maps,
    match_values,
    models,
    rollout,
    serve,
    shm_folder,
)

COMMANDS = (
    fit,
    distill,
    match_values,
    evaluate,
    frontier,
    maps,
    models,
    serve,
    health,
    rollout,
    shm_folder,
    family,
    bench,
    demo,
)
"""Every subcommand's module, in the order ``kvferry --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    from kvferry import __version__

    ap = argparse.ArgumentParser(prog="kvferry", description="Cross-model KV-cache translation.")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--version", action="version", version=f"kvferry {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> None:
    from kvferry.mappings.errors import KvferryError

    a = build_parser().parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    if getattr(a, "lab", False):
        from kvferry.sidecar.memory import tune_allocator

        tune_allocator()  # a lab run frees 100-600 MB of logits a window: map such blocks, as the sidecar does
    try:
        sys.exit(a.func(a))
    except KvferryError as e:
        print(f"kvferry: error: {e}", file=sys.stderr)
        sys.exit(2)
