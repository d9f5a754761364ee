"""`kvferry distill`: a map refined through the frozen target (the tail's KL after the mapped prefix)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvferry import paths
from kvferry.quiet import quiet_transformers

from .args import LAB, add_models, say


def add_parser(sub) -> None:
    dl = sub.add_parser(
        "distill", help="refine a map artifact through the frozen target (KL of the tail after the mapped prefix)"
    )
    dl.add_argument("map", type=Path, help="the starting artifact <root>/<source>__<target>/<version>")
    add_models(dl)
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
        "--out",
        type=Path,
        default=paths.repo_root() / "runs" / "maps",
        help="registry root to write <source>__<target>/<version> (default: runs/maps under kvferry's root, so "
        "a run never writes into the shipped maps)",
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
    dl.add_argument(
        "--keep",
        choices=("best", "last"),
        default="best",
        help="the epoch written: the one with the lowest held-out tail KL (default), or the last one (to measure "
        "what the training reached; with --checkpoint of a finished run it is written without training again)",
    )
    dl.add_argument("--overwrite", action="store_true")
    dl.add_argument("--quiet", action="store_true")
    dl.set_defaults(func=run, **LAB)


def run(a: argparse.Namespace) -> int:
    import random

    from kvferry.mappings.artifact import load, save
    from kvferry.mappings.lab.capture import load_model, read_corpus, token_windows
    from kvferry.mappings.lab.distill import DistillSettings, capture_tails, distill

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
        from kvferry.mappings.lab.distill import with_code_mlp

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
        progress=None if a.quiet else say,
        checkpoint=a.checkpoint,
        checkpoint_every=a.checkpoint_minutes * 60,
        keep=a.keep,
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
