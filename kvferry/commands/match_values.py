"""`kvferry match-values`: a map's values refitted in closed form to the target's attention outputs."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvferry import paths
from kvferry.quiet import quiet_transformers

from .args import LAB, add_models, say


def add_parser(sub) -> None:
    mv = sub.add_parser(
        "match-values",
        help="refit a map's values so the target's attention outputs under its own "
        "queries match its full prefill's, given the mapped keys (closed form)",
    )
    mv.add_argument("map", type=Path, help="the starting artifact <root>/<source>__<target>/<version>")
    add_models(mv)
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
    mv.set_defaults(func=run, **LAB)


def run(a: argparse.Namespace) -> int:
    from kvferry.mappings.artifact import load, save
    from kvferry.mappings.lab.attention_match import MatchSettings, match_values
    from kvferry.mappings.lab.capture import load_model, read_corpus, token_windows

    quiet_transformers()
    settings = MatchSettings(
        lambdas=tuple(a.lambdas), repeat_span=a.repeat_span, heldout_every=a.heldout_every, seed=a.seed
    )
    ms = load(a.map)
    src, tgt = load_model(a.source, ms.source.name), load_model(a.target, ms.target.name)
    windows = token_windows(tgt.tokenizer, read_corpus(a.corpus), a.seq_len, a.max_tokens)
    out, record = match_values(ms, src, tgt, windows, settings, a.version, progress=None if a.quiet else say)
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
