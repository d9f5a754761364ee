"""Write data/next_line_files.json: the files of the next-line task (kvferry.mappings.lab.next_line), from the installed
torch (pinned ==2.13.0 by the project): its .py files of at least 12,000 bytes outside test and _vendor folders,
ordered by the sha256 of their relative path, the first 140, each with its own sha256 (the task refuses a file that
differs). No map is fitted, distilled or evaluated on them elsewhere.

    .venv/bin/python scripts/data/write_next_line_files.py
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "data" / "next_line_files.json"


def main() -> None:
    import torch

    root = Path(torch.__file__).parent
    files = sorted(
        (
            p
            for p in root.rglob("*.py")
            if p.stat().st_size >= 12000 and "test" not in str(p.relative_to(root)) and "_vendor" not in str(p)
        ),
        key=lambda p: hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest(),
    )[:140]
    man = {
        "package": "torch",
        "version": torch.__version__.split("+")[0],
        "license": "BSD-3-Clause (PyTorch)",
        "rule": "the package's .py files of at least 12,000 bytes outside test and _vendor folders, ordered by sha256 "
        "of their relative path; the first 140",
        "purpose": "the next-line task (kvferry.mappings.lab.next_line): "
        "files no map was fitted, distilled or evaluated on",
        "files": [
            {"path": str(p.relative_to(root)), "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files
        ],
    }
    OUT.write_text(json.dumps(man, indent=1) + "\n")
    print(f"{OUT}: {len(files)} files of torch {man['version']}")


if __name__ == "__main__":
    main()
