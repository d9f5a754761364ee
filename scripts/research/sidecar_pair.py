"""What the sidecar-side research scripts share: the pair's arguments, and the pair with the map the sidecar serves."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvferry import paths
from kvferry.bench.harness import long_ids
from kvferry.client.client import chunk_tokens_for, encode_requests, make_spec
from kvferry.mappings.capture import capture_kv, load_model
from kvferry.sidecar.registry import MapRegistry


def pair_arguments(ap: argparse.ArgumentParser, reps: int) -> None:
    ap.add_argument("--source", type=Path, required=True)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--maps-dir", type=Path, default=paths.maps_dir())
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--threads", type=int, default=2)


def load_pair(a: argparse.Namespace):
    """(source, target, the newest servable map between them, the header fields that identify the source)."""
    torch.set_num_threads(a.threads)
    source, target = load_model(a.source), load_model(a.target)
    registry = MapRegistry(a.maps_dir, force=True)
    registry.scan()
    ms = registry.resolve(f"{source.identity.name}__{target.identity.name}", "")
    kw = dict(source_geometry=source.identity.geometry.fingerprint, tokenizer=source.identity.tokenizer)
    return source, target, ms, kw


def translate_inputs(source, target, ms, kw: dict, options, n: int) -> tuple[list, list[bytes]]:
    """The source cache of a held-out prompt of ``n`` tokens (16 left to the target) and the request messages the
    client sends for it with ``options`` (what the echo sends back, to time gRPC alone on the same bytes)."""
    with torch.no_grad():
        src = capture_kv(source.model, long_ids(target.tokenizer, n)[:, : n - 16])
    payloads = [m.SerializeToString() for m in encode_requests(make_spec(src, ms.name, ms.version, **kw), src,
                                                              chunk_tokens_for(options, src))]
    return src, payloads
