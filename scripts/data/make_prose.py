"""Write data/prose_heldout.jsonl (held-out English prose) or, with --split calib, data/prose_calib.jsonl.

Source: CPython's own help topics (``pydoc_data.topics``, the Language Reference as plain text; PSF license),
which every Python install ships. Topics of at least 2,000 characters are taken in sorted order: the first ones,
until ``--chars`` characters, are held out; ``--split calib`` writes every later topic, for calibration (the two
files share no topic).
"""

import argparse
import hashlib
import json
import pydoc_data.topics as topics
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", choices=["heldout", "calib"], default="heldout")
    ap.add_argument("--out", type=Path, default=None, help="default: data/prose_<split>.jsonl")
    ap.add_argument("--chars", type=int, default=160_000, help="characters of the held-out split")
    a = ap.parse_args()
    rows, total, held = [], 0, 0
    for name in sorted(topics.topics):
        text = topics.topics[name].strip()
        if len(text) < 2000:
            continue
        in_heldout = held < a.chars
        held += len(text) if in_heldout else 0
        if in_heldout == (a.split == "heldout"):
            rows.append(json.dumps({"topic": name, "text": text}))
            total += len(text)
    out = a.out or DATA / f"prose_{a.split}.jsonl"
    blob = ("\n".join(rows) + "\n").encode()
    out.write_bytes(blob)
    print(f"{out}: {len(rows)} topics, {total} chars, sha256 {hashlib.sha256(blob).hexdigest()}")


if __name__ == "__main__":
    main()
