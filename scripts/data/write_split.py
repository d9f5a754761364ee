"""Write one split of the code corpus (data/corpus.json) as JSONL, for ``kvferry distill --corpus`` or ``kvferry fit``.

The splits name files of CPython's standard library (PSF license), read from this Python, so nothing is downloaded.
data/calib.jsonl and data/heldout.jsonl are the calib and heldout splits, shipped; the train split (607 files) is
written on demand. Files are shuffled with seed 0: the list is alphabetical, and a prefix of it would be a few packages.

``--docstrings``: instead of the code, the split's English prose: each file's module, class and function docstrings
of at least ``--min-chars`` characters, joined with blank lines (one row per file that has any). The train split's
code and docstrings are the distillation corpus (data/distill_corpus.json records their digests): no evaluation reads
them (the evaluation's code is the heldout split, its prose the Language Reference, data/prose_heldout.jsonl).

    .venv/bin/python scripts/data/write_split.py --split train --out runs/data/train.jsonl
    .venv/bin/python scripts/data/write_split.py --split train --docstrings --out runs/data/train_prose.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sysconfig
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus.json"


def split_texts(split: str) -> list[str]:
    """The split's files, read from this Python's standard library (missing ones skipped), shuffled with seed 0."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    rels = json.loads(CORPUS.read_text())["splits"][split]["paths"]
    texts = [(lib / rel).read_text(encoding="utf-8", errors="replace") for rel in rels if (lib / rel).exists()]
    random.Random(0).shuffle(texts)
    return texts


def docstrings(source: str, min_chars: int) -> str:
    """A file's docstrings of at least ``min_chars`` characters (module, classes, functions, in file order), joined."""
    import ast
    import inspect

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    docs = [inspect.cleandoc(d) for n in nodes if (d := ast.get_docstring(n, clean=False))]
    return "\n\n".join(d for d in docs if len(d) >= min_chars)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", default="train")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--docstrings", action="store_true", help="the split's docstrings (English prose), not its code")
    ap.add_argument("--min-chars", type=int, default=300, help="shortest docstring kept with --docstrings")
    a = ap.parse_args()
    if a.min_chars < 1:
        ap.error(f"--min-chars must be positive, got {a.min_chars}")
    texts = split_texts(a.split)
    if a.docstrings:
        texts = [d for d in (docstrings(t, a.min_chars) for t in texts) if d]
    blob = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_bytes(blob)
    print(f"{a.out}: {len(texts)} files, {sum(map(len, texts))} chars, sha256 {hashlib.sha256(blob).hexdigest()}")


if __name__ == "__main__":
    main()
