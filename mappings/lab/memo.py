"""The target's own results on the evaluation's prompts, computed once and kept: an evaluation's references.

The copy probe's, the completion task's and the next-line task's ``full`` and ``truncate`` arms are the target's own
work on fixed prompts: on Qwen2.5-Coder-1.5B they are most of an evaluation's time (a 3,000-token prefill per
prompt). A :class:`Memo` keeps each such result under a key made of the target's identity (its weights' sha256
included), the probe's settings and the prompt's tokens, so an evaluation of any map of the pair runs only the arms
under test.

A file is pinned (its first line) to the target's weights, its geometry and the precision the forwards ran in
(:class:`Pin`); opening it for another target or precision is refused. Opened ``frozen`` (committed references, as
``data/references/``), a prompt it has no result for is refused too: the prompt set or the probe's settings changed,
and the file must be rebuilt, never silently mixed with fresh results.

File format (JSON lines, golden-tested): ``{"pin": {...}}`` first, then ``{"k": key, "v": value}`` per result, later
lines winning; a torn last line (a stopped run) is ignored. A key is :func:`Memo.key` of the result's parts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import InvalidInput
from ..geometry import digest


@dataclass(frozen=True)
class Pin:
    """What a file of references belongs to."""

    target_weights: str
    """The target's weights digest (``ModelIdentity.weights``)."""
    target_geometry: str
    """The target's geometry fingerprint."""
    precision: str
    """The precision the evaluation's forwards ran in (``float32`` or ``bfloat16``)."""

    @classmethod
    def of(cls, target, precision: str) -> Pin:
        """The pin of a loaded target model evaluated at ``precision``."""
        return cls(target.identity.weights, target.identity.geometry.fingerprint, precision)


class Memo:
    """A pinned JSON-lines file of key -> value (see the module's docstring)."""

    def __init__(self, path: str | Path, pin: Pin, frozen: bool = False):
        self.path = Path(path)
        self.pin = pin
        self.frozen = frozen
        self.values: dict[str, object] = {}
        if not self.path.is_file():
            if frozen:
                raise InvalidInput(f"no references at {self.path}: build them once with --update-references")
            return
        lines = self.path.read_text().splitlines()
        try:
            found = json.loads(lines[0])["pin"] if lines else None
        except (ValueError, KeyError, TypeError):
            found = None
        if found != asdict(pin):
            raise InvalidInput(
                f"the references at {self.path} were made for {found}, not for this evaluation's "
                f"{asdict(pin)} (another target's weights, geometry or precision): point --references "
                "at a file of this target's, or build a new one with --update-references"
            )
        for line in lines[1:]:
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
        if self.frozen:
            raise InvalidInput(f"the references at {self.path} are frozen; add to them with --update-references")
        self.values[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.is_file() or self.path.stat().st_size == 0
        with open(self.path, "a") as f:
            if new:
                f.write(json.dumps({"pin": asdict(self.pin)}) + "\n")
            f.write(json.dumps({"k": key, "v": value}) + "\n")


def remembered(memo: Memo | None, key_parts: tuple, compute):
    """``compute()``, or its value kept in ``memo`` under ``key_parts``; a frozen memo without it is refused."""
    if memo is None:
        return compute()
    key = Memo.key(*key_parts)
    value = memo.get(key)
    if value is None:
        if memo.frozen:
            raise InvalidInput(
                f"the references at {memo.path} have no result for the {key_parts[0]} arm of one of "
                "this evaluation's prompts: its prompts or settings differ from those the references "
                "were built for. Evaluate with the settings they were built with, or rebuild them with "
                "--update-references"
            )
        value = compute()
        memo.put(key, value)
    return value
