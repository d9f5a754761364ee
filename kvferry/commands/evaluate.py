"""`kvferry eval`: a map's evidence on held-out text (the measures the serving gates read)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvferry import paths
from kvferry.quiet import quiet_transformers

from .args import LAB, add_models, add_references, check_references, references


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="measure a map's evidence on held-out text (JSON + table)")
    e.add_argument("map", type=Path, help="artifact directory <root>/<source>__<target>/<version>")
    add_models(e)
    e.add_argument("--heldout", nargs="+", default=[str(paths.data_file("heldout.jsonl"))])
    e.add_argument("--prompts", type=int, default=100)
    e.add_argument("--min-len", type=int, default=128)
    e.add_argument("--max-len", type=int, default=512)
    e.add_argument("--refresh", type=int, default=16)
    e.add_argument("--sinks", type=int, default=4)
    e.add_argument(
        "--positions",
        type=int,
        default=1,
        help="next-token positions scored per prompt: its next token and the text's next positions - 1, "
        "teacher-forced past the refresh window (EvalSettings.positions)",
    )
    e.add_argument("--greedy-prompts", type=int, default=16)
    e.add_argument("--recall-prompts", type=int, default=50)
    e.add_argument(
        "--copy-gaps",
        default="500,1000,3000",
        help='copy-probe gaps in tokens, comma-separated ("none" skips the probe, and the long-range gate then '
        "refuses the map)",
    )
    e.add_argument("--copy-prompts", type=int, default=12, help="copy-probe prompts per gap (CopySettings.prompts)")
    e.add_argument(
        "--copy-plain",
        action="store_true",
        help="copy-probe passages as written (default: scrambled, so that only the passage predicts them)",
    )
    e.add_argument(
        "--next-line-tasks",
        type=int,
        default=0,
        help="the next-line task (LCC style: a file's next line after 2,000+ tokens of it, scored by edit "
        "similarity) on this many files of data/next_line_files.json (0: skip); the gate's downstream "
        "bar reads it",
    )
    e.add_argument(
        "--completion-tasks",
        type=int,
        default=0,
        help="downstream task: functions whose first body line the target writes after the file (0 skips)",
    )
    e.add_argument(
        "--only-copy", action="store_true", help="run only the copy probe and add it to the existing evidence"
    )
    e.add_argument(
        "--prose", nargs="*", default=None, help="held-out prose (e.g. data/prose_heldout.jsonl) for next-token metrics"
    )
    e.add_argument("--prose-prompts", type=int, default=50)
    add_references(e)
    e.add_argument("--json", default=None, help="write the evidence JSON here")
    e.add_argument("--write", action="store_true", help="record the evidence in the artifact's manifest")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=run, **LAB)


def run(a: argparse.Namespace) -> int:
    import time

    from kvferry.mappings.artifact import load, write_evidence
    from kvferry.mappings.lab.capture import load_model
    from kvferry.mappings.lab.copy_probe import format_copy_table
    from kvferry.mappings.precision import autocast

    quiet_transformers()
    check_references(a, "eval")
    ms = load(a.map)
    src, tgt = load_model(a.source, ms.source.name), load_model(a.target, ms.target.name)
    copy = _copy_settings(a)
    memo = references(a, tgt)
    started = time.monotonic()
    with autocast(tgt.model, a.precision):
        ev = _evaluate(a, ms, src, tgt, copy, memo)
    ev["precision"] = a.precision
    print(
        f"evaluated in {time.monotonic() - started:.0f} s ({a.precision}"
        + (f", references {a.references}" if a.references else ", no references")
        + ")"
    )
    if "copy" in ev:
        print(format_copy_table(ev["copy"], "long-range copy probe (next-token accuracy on the repeated passage)"))
    if "copy" in ev.get("prose", {}):
        print(format_copy_table(ev["prose"]["copy"], "long-range copy probe on prose"))
    if a.json:
        Path(a.json).write_text(json.dumps(ev, indent=1) + "\n")
    if a.write:
        write_evidence(a.map, ev)
        print(f"evidence written to {Path(a.map) / 'manifest.json'}")
    return 0


def _copy_settings(a: argparse.Namespace):
    from kvferry.mappings.lab.copy_probe import CopySettings

    if a.copy_gaps.strip().lower() == "none":
        return None
    gaps = tuple(int(g) for g in a.copy_gaps.split(","))
    return CopySettings(gaps=gaps, prompts=a.copy_prompts, refresh=a.refresh, unguessable=not a.copy_plain)


def _evaluate(a: argparse.Namespace, ms, src, tgt, copy, memo) -> dict:
    """``kvferry eval``'s measurements (printing each table but the copy probe's), in the caller's precision."""
    from kvferry.mappings.lab.capture import read_corpus
    from kvferry.mappings.lab.completion import CompletionSettings, format_completion_table
    from kvferry.mappings.lab.copy_probe import copy_probe
    from kvferry.mappings.lab.evaluate import EvalSettings, evaluate, format_table
    from kvferry.mappings.lab.next_line import NextLineSettings, format_next_line_table

    if a.only_copy:
        if copy is None:
            raise SystemExit("kvferry eval: --only-copy needs --copy-gaps")
        ev = dict(ms.evidence or {})
        if ev.get("precision", "float32") != a.precision:
            raise SystemExit(
                f"kvferry eval: the artifact's evidence was measured in {ev.get('precision', 'float32')}; "
                f"--only-copy at {a.precision} would mix the two. Use --precision {ev.get('precision', 'float32')}"
            )
        ev["copy"] = copy_probe(ms, src, tgt, list(read_corpus(a.heldout)), copy, progress=not a.quiet, memo=memo)
    else:
        settings = EvalSettings(
            prompts=a.prompts,
            refresh=a.refresh,
            sinks=a.sinks,
            recall_prompts=a.recall_prompts,
            positions=a.positions,
            greedy_prompts=a.greedy_prompts,
            min_len=a.min_len,
            max_len=a.max_len,
            copy=copy,
            prose_prompts=a.prose_prompts if a.prose else 0,
            completion=CompletionSettings(tasks=a.completion_tasks, refresh=a.refresh) if a.completion_tasks else None,
            next_line=NextLineSettings(tasks=a.next_line_tasks, refresh=a.refresh) if a.next_line_tasks else None,
        )
        ev = evaluate(ms, src, tgt, a.heldout, settings, progress=not a.quiet, prose=a.prose, memo=memo)
        print(format_table(ev, f"{ms.name} {ms.version} (r={a.refresh}, s={a.sinks}, {a.prompts} prompts)"))
        for kind in "kv":
            print(
                f"held-out R² per target layer, {kind.upper()}: "
                + " ".join(f"{r['layer']}:{r['r2']:.2f}" for r in ev["layers"] if r["kind"] == kind)
            )
        if "prose" in ev:
            print(format_table(ev["prose"], f"prose ({a.prose_prompts} prompts)"))
        if "completion" in ev:
            print(format_completion_table(ev["completion"], "completion task (exact match of a function's first line)"))
        if "next_line" in ev:
            print(
                format_next_line_table(ev["next_line"], "next-line task (a file's next line after 2,000+ tokens of it)")
            )
    return ev
