"""Results that do not depend on the map, kept across evaluations of one pair.

The copy probe's and the completion task's ``full`` and ``truncate`` arms are the target's own work on fixed
prompts: on Qwen2.5-Coder-1.5B they are most of an evaluation's time (a 3,000-token prefill per prompt). A
:class:`Memo` keeps each such result under a key made of the target's identity (its weights' sha256 included),
the probe's settings and the prompt's tokens, so evaluating another map of the same pair recomputes only the
mapped arms. A memo is a cache: deleting it changes no result.
"""

from __future__ import annotations

import json
from pathlib import Path

from .geometry import digest


class Memo:
    """A JSON-lines file of key -> value; later lines win; a torn last line (a stopped run) is ignored."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.values: dict[str, object] = {}
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    self.values[row["k"]] = row["v"]
                except (ValueError, KeyError, TypeError):
                    continue

    @staticmethod
    def key(*parts) -> str:
        return digest(list(parts))

    def get(self, key: str):
        return self.values.get(key)

    def put(self, key: str, value) -> None:
        self.values[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"k": key, "v": value}) + "\n")


def remembered(memo: Memo | None, key_parts: tuple, compute):
    """``compute()``, or its value kept in ``memo`` under ``key_parts``."""
    if memo is None:
        return compute()
    key = Memo.key(*key_parts)
    value = memo.get(key)
    if value is None:
        value = compute()
        memo.put(key, value)
    return value
