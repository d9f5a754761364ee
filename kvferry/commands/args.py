"""What several commands share: their common flags (the model pair, the references), the parsers of list-valued
flags, and the progress line of a long run."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvferry import paths
from kvferry.pretrained import model_path

LAB = {"lab": True}
"""set_defaults of an offline command (fit, distill, eval, ...): main tunes the allocator before it runs, since a lab
run frees hundreds of MB of logits a window (kvferry.sidecar.memory says why that matters)."""


def add_models(p: argparse.ArgumentParser) -> None:
    """--source and --target: the pair a map is made, measured or refined for."""
    p.add_argument(
        "--source",
        type=model_path,
        default=paths.model_dir("S"),
        help="source: an HF model folder, or a known model by name (kvferry models fetch)",
    )
    p.add_argument(
        "--target",
        type=model_path,
        default=paths.model_dir("T"),
        help="target: an HF model folder, or a known model by name",
    )


def add_references(p: argparse.ArgumentParser) -> None:
    """--references, --update-references and --precision: the target's own results, kept and pinned."""
    p.add_argument(
        "--references",
        type=Path,
        default=None,
        help="the target's own results on the probes' prompts (e.g. data/references/qwen2.5-coder-1.5b.jsonl): "
        "read, and a prompt they lack is refused; an evaluation then runs only the arms under test",
    )
    p.add_argument(
        "--update-references",
        action="store_true",
        help="compute what --references lacks and add it (builds the file on first use)",
    )
    p.add_argument(
        "--precision",
        choices=("float32", "bfloat16"),
        default="float32",
        help="every forward's precision (bfloat16: autocast, about 4x faster on CPUs with bf16 matrix units); "
        "recorded in the evidence and pinned in --references",
    )


def check_references(a: argparse.Namespace, command: str) -> None:
    """--update-references without --references is a usage error, found before any model loads."""
    if a.update_references and not a.references:
        raise SystemExit(f"kvferry {command}: --update-references needs --references FILE")


def references(a: argparse.Namespace, target):
    """The run's references (``--references``, added to with ``--update-references``), pinned to ``target`` and
    ``--precision``; None without ``--references``."""
    from kvferry.mappings.lab.memo import Memo, Pin

    return Memo(a.references, Pin.of(target, a.precision), frozen=not a.update_references) if a.references else None


def layer_range(text: str) -> tuple[int, int]:
    """ "18-24" (or one layer, "18") -> (18, 24)."""
    try:
        first, _, last = text.partition("-")
        return int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST-LAST target layers such as 18-24, got {text!r}") from None


def int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers ("" is empty), or a usage error naming the item."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if not item.isdigit() or int(item) < 1:
            raise argparse.ArgumentTypeError(f"{item!r} is not a positive whole number")
        out.append(int(item))
    return tuple(out)


def say(line: str) -> None:
    """A long run's progress line, written at once (a log file would otherwise hold it back for hours)."""
    print(line, flush=True)
