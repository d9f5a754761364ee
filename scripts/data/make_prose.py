"""Write data/prose_heldout.jsonl: English prose for held-out next-token metrics.

Source: CPython's own help topics (``pydoc_data.topics``, the Language Reference as plain text; PSF license),
which every Python install ships. Code appears only in the calibration corpus, so all of this is held out
from map fitting. Topics are taken in sorted order until ``--chars`` characters are reached.
"""

import argparse
import hashlib
import json
from pathlib import Path

import pydoc_data.topics as topics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "data" / "prose_heldout.jsonl")
    ap.add_argument("--chars", type=int, default=160_000)
    a = ap.parse_args()
    rows, total = [], 0
    for name in sorted(topics.topics):
        text = topics.topics[name].strip()
        if len(text) < 2000:
            continue
        rows.append(json.dumps({"topic": name, "text": text}))
        total += len(text)
        if total >= a.chars:
            break
    blob = ("\n".join(rows) + "\n").encode()
    a.out.write_bytes(blob)
    print(f"{a.out}: {len(rows)} topics, {total} chars, sha256 {hashlib.sha256(blob).hexdigest()}")


if __name__ == "__main__":
    main()
