"""`kvferry family corpus|tokenizer|train|card`: build the shipped tiny model family (kvferry.mappings.lab.family)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvferry import paths

FAMILY_MODELS = ("S", "T", "T64")
"""The family's members (kvferry.mappings.lab.family.FAMILY), named here: building the parser imports no torch."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "family",
        help="build the shipped tiny family from the interpreter's standard library: corpus, tokenizer, S / T / T64, "
        "model card (seeded, offline)",
    )
    p.add_argument("step", choices=["corpus", "tokenizer", "train", "card"])
    p.add_argument("--out", type=Path, default=paths.repo_root(), help="root to write data/ and models/ under")
    p.add_argument("--model", choices=FAMILY_MODELS, help="train: the member to train")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument(
        "--warmup-copy", type=int, default=200, help="pure copy steps before the mix (forms induction heads)"
    )
    p.add_argument("--resume", action="store_true", help="continue models/<name> on the mix (a second stage)")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from kvferry.mappings.lab import family

    if a.step == "corpus":
        family.cmd_corpus(a.out)
    elif a.step == "tokenizer":
        family.cmd_tokenizer(a.out)
    elif a.step == "card":
        family.cmd_card(a.out)
    else:
        if not a.model:
            raise SystemExit("kvferry family train: --model is required (S, T or T64)")
        family.cmd_train(a.out, a.model, a.steps, a.batch, a.lr, a.seed, a.eval_every, a.warmup_copy, a.resume)
    return 0
