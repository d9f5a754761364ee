"""`kvferry fit`: closed-form maps source -> target, written as a versioned artifact."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvferry import paths
from kvferry.quiet import quiet_transformers

from .args import LAB, add_models, layer_range


def add_parser(sub) -> None:
    f = sub.add_parser("fit", help="fit closed-form ridge maps source->target and write a versioned artifact")
    add_models(f)
    f.add_argument("--source-name", default=None, help="name recorded for the source (default: folder name)")
    f.add_argument("--target-name", default=None, help="name recorded for the target (default: folder name)")
    f.add_argument(
        "--corpus", nargs="+", default=[str(paths.data_file("calib.jsonl"))], help="text files, folders or JSONL"
    )
    f.add_argument(
        "--out", type=Path, default=paths.maps_dir(), help="registry root to write <source>__<target>/<version>"
    )
    f.add_argument("--version", default="1.0.0")
    f.add_argument("--k", type=int, default=4, help="source layers per target map")
    f.add_argument(
        "--inputs",
        choices=["kv", "same"],
        default="kv",
        help="kv: each map reads the source layers' K and V; same: K from K, V from V",
    )
    f.add_argument(
        "--selection",
        choices=["greedy", "ranked"],
        default="greedy",
        help="greedy: forward selection of source layers (default); ranked: the k best layers alone (fast for wide "
        "models)",
    )
    f.add_argument(
        "--min-gain",
        type=float,
        default=0.0,
        help="greedy: stop adding source layers once the next raises held-out R² by less than this (0: always k)",
    )
    f.add_argument("--per-head", action="store_true", help="block-diagonal maps (target head j reads one source head)")
    f.add_argument(
        "--basis-rank",
        type=int,
        default=None,
        metavar="R",
        help="one shared low-rank code of every source layer's K and V, R numbers per token, read by every "
        "target map (reduced-rank regression; --k and --selection do not apply); prints the cost/R² curve",
    )
    f.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights' stored and applied dtype (bfloat16: faster apply; evaluate it before serving)",
    )
    # --window .. --window-sources: FitSettings' fields (their defaults and meaning are documented there)
    f.add_argument(
        "--window", type=int, default=1, help="tokens a windowed map reads per output token (1: per-token maps)"
    )
    f.add_argument(
        "--window-layers",
        type=layer_range,
        default=None,
        metavar="FIRST-LAST",
        help="target layers whose maps are windowed, e.g. 18-24 (default: all, when --window > 1)",
    )
    f.add_argument("--window-kinds", choices=["k", "kv"], default="k", help="window the keys only (default) or K and V")
    f.add_argument(
        "--window-sources", type=int, default=6, help="windowed maps read the source's last this-many layers"
    )
    f.add_argument("--seq-len", type=int, default=512)
    f.add_argument("--max-tokens", type=int, default=None)
    f.add_argument("--subsample", type=float, default=1.0, help="fraction of positions kept")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument(
        "--stats",
        type=Path,
        default=None,
        help="reuse the Gram sums captured in this file (same models, corpus, capture settings), else capture and "
        "write them there",
    )
    f.add_argument(
        "--features",
        type=Path,
        default=None,
        help="keep each window's captured features in this folder: a stopped capture resumes, and refits with "
        "other capture settings (--window, --subsample) skip the forward passes",
    )
    f.add_argument("--overwrite", action="store_true")
    f.add_argument("--quiet", action="store_true")
    f.set_defaults(func=run, **LAB)


def run(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    from kvferry.mappings.artifact import save
    from kvferry.mappings.lab.capture import load_model
    from kvferry.mappings.lab.fit import FitSettings, fit_pair

    quiet_transformers()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    settings = FitSettings(
        k=a.k,
        seq_len=a.seq_len,
        max_tokens=a.max_tokens,
        subsample=a.subsample,
        seed=a.seed,
        inputs=a.inputs,
        per_head=a.per_head,
        dtype=a.dtype,
        selection=a.selection,
        min_gain=a.min_gain,
        window=a.window,
        window_layers=a.window_layers,
        window_kinds=a.window_kinds,
        window_sources=a.window_sources,
        basis_rank=a.basis_rank,
    )
    src, tgt = load_model(a.source, a.source_name), load_model(a.target, a.target_name)
    ms = fit_pair(
        src, tgt, a.corpus, settings, a.version, progress=not a.quiet, stats_path=a.stats, features=a.features
    )
    if ms is not None:
        dest = save(ms, a.out, overwrite=a.overwrite)
        print(f"wrote {dest}")
        for (t, kind), m in sorted(ms.maps.items()):
            span = f" x {m.window} tokens" if m.window > 1 else ""
            reads = f"the basis (rank {ms.basis.rank})" if ms.basis else f"sources {list(m.source_layers)}{span}"
            print(f"  layer {t} {kind.upper()}: {reads}  lambda {m.lam:g}  held-out R² {m.heldout_r2:.4f}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0
