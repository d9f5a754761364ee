"""`kvferry frontier`: each gated measure against the share of the target's prefill spent."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvferry import paths
from kvferry.quiet import quiet_transformers

from .args import LAB, add_models, add_references, check_references, int_list, references


def add_parser(sub) -> None:
    fr = sub.add_parser(
        "frontier",
        help="each gated measure against the share of the target's prefill spent, for "
        "truncation, each map's refresh and hybrid points: JSON, a table and a plot",
    )
    fr.add_argument("maps", type=Path, nargs="+", help="artifacts of one pair, <root>/<source>__<target>/<version>")
    add_models(fr)
    fr.add_argument("--heldout", nargs="+", default=[str(paths.data_file("heldout.jsonl"))], help="held-out code")
    fr.add_argument("--prose", nargs="*", default=None, help="held-out prose, a second domain")
    fr.add_argument("--refreshes", type=int_list, default=(16, 64, 256, 1024), help="r values, comma-separated")
    fr.add_argument(
        "--hybrid", type=int_list, default=(4, 8), help="target layers the target computes itself ('' for none)"
    )
    fr.add_argument("--copy-gaps", type=int_list, default=(500, 1000, 3000))
    fr.add_argument("--copy-prompts", type=int, default=12)
    fr.add_argument("--next-token-prompts", type=int, default=20, help="per domain (0: no top-10 measure)")
    fr.add_argument(
        "--next-line-tasks",
        type=int,
        default=24,
        help="the downstream task's files (a file's next line after 2,000+ tokens of it, data/next_line_files.json; "
        "0: not measured)",
    )
    add_references(fr)
    fr.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.png")
    fr.add_argument("--quiet", action="store_true")
    fr.set_defaults(func=run, **LAB)


def run(a: argparse.Namespace) -> int:
    import time

    from kvferry.mappings.artifact import load
    from kvferry.mappings.lab.capture import load_model, read_corpus
    from kvferry.mappings.lab.copy_probe import CopySettings
    from kvferry.mappings.lab.frontier import (
        FrontierSettings,
        copy_points,
        format_frontier,
        next_line_points,
        plot,
        summarize,
        top10_points,
    )
    from kvferry.mappings.lab.next_line import NextLineSettings, library_files
    from kvferry.mappings.precision import autocast

    quiet_transformers()
    sets = [load(p) for p in a.maps]
    first = sets[0]
    if any((m.source.name, m.target.name) != (first.source.name, first.target.name) for m in sets):
        raise SystemExit("kvferry frontier: every map must be of one pair")
    maps = {m.version: m for m in sets}
    check_references(a, "frontier")
    s = FrontierSettings(
        refreshes=a.refreshes,
        hybrid_layers=a.hybrid,
        next_token_prompts=a.next_token_prompts,
        copy=CopySettings(gaps=a.copy_gaps, prompts=a.copy_prompts),
        next_line=NextLineSettings(tasks=a.next_line_tasks) if a.next_line_tasks else None,
    )
    src, tgt = load_model(a.source, first.source.name), load_model(a.target, first.target.name)
    memo = references(a, tgt)
    domains = {"code": a.heldout} | ({"prose": a.prose} if a.prose else {})
    started, raw = time.monotonic(), {}
    with autocast(tgt.model, a.precision):
        for domain, files in domains.items():
            texts = list(read_corpus(files))
            raw[domain] = {"copy": copy_points(maps, src, tgt, texts, s, memo, progress=not a.quiet)}
            if s.next_token_prompts:
                raw[domain]["top10"] = top10_points(maps, src, tgt, texts, s)
        if s.next_line is not None:
            files = library_files(paths.data_file("next_line_files.json"))
            raw["next_line"] = next_line_points(maps, src, tgt, files, s, memo, progress=not a.quiet)
    front = summarize(raw, s, list(maps), tgt.identity.geometry.layers) | {
        "pair": first.name,
        "precision": a.precision,
        "seconds": round(time.monotonic() - started, 1),
    }
    print(format_frontier(front))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(front, indent=1) + "\n")
    plot(front, a.out.with_suffix(".png"), f"{first.name}: quality against the target's prefill spent")
    print(f"wrote {a.out.with_suffix('.json')} and {a.out.with_suffix('.png')} ({front['seconds']:.0f} s)")
    return 0
