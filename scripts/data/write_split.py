"""Write one split of the code corpus (data/corpus.json) as JSONL, for ``kvferry distill --corpus`` or ``kvferry fit``.

The splits name files of CPython's standard library (PSF license), read from this Python, so nothing is downloaded.
data/calib.jsonl and data/heldout.jsonl are the calib and heldout splits, shipped; the train split (607 files) is
written on demand. Files are shuffled with seed 0: the list is alphabetical, and a prefix of it would be a few packages.

    .venv/bin/python scripts/data/write_split.py --split train --out runs/data/train.jsonl
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", default="train")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    texts = split_texts(a.split)
    blob = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_bytes(blob)
    print(f"{a.out}: {len(texts)} files, sha256 {hashlib.sha256(blob).hexdigest()}")


if __name__ == "__main__":
    main()
