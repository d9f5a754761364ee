"""A long-context downstream task in the style of LongBench's LCC: write a file's next line after 2,000+ tokens of it.

Each task is one held-out source file, scrambled (:mod:`scramble`: its names become made-up words, consistently, so
that the file, not the model's memory of it, decides the answer), cut at the start of a code line chosen at random
(seeded) among those with at least ``min_context`` tokens of the file before them. The model writes one line
greedily; the score is its edit similarity to the file's own line (difflib's ratio, 2·matches / total characters,
surrounding whitespace ignored), with exact match beside it. Files come from a pinned package that no map was fitted
or distilled on (:func:`library_files`), so the task is held out for every map.

Arms, on the same prompts (the same compute as the copy probe's):
  full            the target's own prefill of the whole prompt
  truncate        the target sees only the prompt's last r tokens
  mapped_refresh  the mapped cache for all but the last r tokens; the target recomputes those r, then writes
"""

from __future__ import annotations

import bisect
import difflib
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ..artifact import MapSet
from ..errors import InvalidInput
from .capture import LoadedModel
from .completion import written_lines
from .memo import Memo
from .scramble import scramble


@dataclass(frozen=True)
class NextLineSettings:
    """Which lines become tasks, and how long their prompts are."""

    tasks: int = 100
    """Tasks, one per file (the first ``tasks`` files of the list that hold a qualifying line)."""
    min_context: int = 2000
    """A line qualifies only if at least this many tokens of its file come before it."""
    max_context: int = 4096
    """Prompts are the last this-many tokens before the line (longer files are cut at the start)."""
    min_chars: int = 12
    """A line qualifies only with at least this many characters of code (not a comment, not a lone bracket)."""
    refresh: int = 16
    """r: tokens the target recomputes in the truncate and mapped_refresh arms."""
    max_new_tokens: int = 48
    """Longest answer written; a line not finished by then scores what it has."""
    seed: int = 0
    """Seeds the scrambling and the choice of line."""

    def __post_init__(self) -> None:
        if (
            self.tasks < 1
            or not 1 <= self.refresh < self.min_context <= self.max_context
            or self.max_new_tokens < 1
            or self.min_chars < 1
        ):
            raise InvalidInput(
                "next-line needs tasks >= 1, 1 <= refresh < min_context <= max_context, "
                "max_new_tokens >= 1 and min_chars >= 1"
            )

    def as_dict(self) -> dict:
        return {
            "tasks": self.tasks,
            "min_context": self.min_context,
            "max_context": self.max_context,
            "min_chars": self.min_chars,
            "refresh": self.refresh,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class NextLineTask:
    prompt: list[int]
    """Token ids: the file up to the line (its indentation included)."""
    answer: str
    """The line, without surrounding whitespace."""


def edit_similarity(got: str | None, want: str) -> float:
    """difflib's ratio of the two lines, surrounding whitespace ignored (1: identical; None, an unfinished line: 0)."""
    if got is None:
        return 0.0
    got, want = got.strip(), want.strip()
    if not got and not want:
        return 1.0
    return difflib.SequenceMatcher(None, got, want, autojunk=False).ratio()


def _qualifies(line: str, min_chars: int) -> bool:
    code = line.strip()
    return len(code) >= min_chars and not code.startswith(("#", '"""', "'''", "@")) and any(c.isalnum() for c in code)


def make_tasks(tokenizer, texts: list[str], s: NextLineSettings) -> list[NextLineTask]:
    """One task per file, in the files' order, until ``s.tasks``; a file without a qualifying line is skipped."""
    tasks = []
    for i, text in enumerate(texts):
        text = scramble(text, s.seed)
        starts, pos = [], 0
        for line in text.split("\n"):
            if _qualifies(line, s.min_chars):
                starts.append((pos, line))
            pos += len(line) + 1
        # tokens before each line, from one tokenization of the file (its tokens' start offsets)
        offsets = [
            a for a, _ in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        ]
        candidates = [(start, line) for start, line in starts if bisect.bisect_left(offsets, start) >= s.min_context]
        if not candidates:
            continue
        start, line = random.Random(f"{s.seed}:{i}").choice(candidates)
        indent = len(line) - len(line.lstrip(" \t"))
        prompt = tokenizer(text[: start + indent], add_special_tokens=False)["input_ids"]
        tasks.append(NextLineTask(prompt[-s.max_context :], line.strip()))
        if len(tasks) == s.tasks:
            return tasks
    raise InvalidInput(
        f"the files hold {len(tasks)} lines with {s.min_context}+ tokens before them; {s.tasks} were "
        "asked for. Add files or lower tasks / min_context."
    )


@torch.no_grad()
def next_line_task(
    ms: MapSet | None,
    source: LoadedModel | None,
    target: LoadedModel,
    texts: list[str],
    s: NextLineSettings | None = None,
    progress: bool = False,
    memo: Memo | None = None,
) -> dict:
    """Each arm's mean edit similarity and exact-match rate on the tasks, with each task's scores (``per_task``, for
    the gate's intervals); ``ms`` None: only the target's own arms (which come from ``memo`` when it has them)."""
    s = s or NextLineSettings()
    tasks = make_tasks(target.tokenizer, texts, s)
    lines = written_lines(
        ms, source, target, [t.prompt for t in tasks], s.refresh, s.max_new_tokens, "next-line", progress, memo
    )
    return score(lines, [t.answer for t in tasks], s)


def score(lines: dict[str, list[str | None]], answers: list[str], s: NextLineSettings) -> dict:
    """The evidence of written ``lines`` (per arm, one per task) against the files' ``answers``."""
    per_task = {
        arm: {
            "edit_sim": [round(edit_similarity(got, want), 6) for got, want in zip(got_lines, answers)],
            "exact": [int(got is not None and got.strip() == want) for got, want in zip(got_lines, answers)],
        }
        for arm, got_lines in lines.items()
        if got_lines
    }
    arms = {arm: {k: sum(v) / len(v) for k, v in scores.items()} for arm, scores in per_task.items()}
    return {"settings": s.as_dict(), "arms": arms, "per_task": per_task}


def library_files(manifest: str | Path) -> list[str]:
    """The task's files, read from the installed package a manifest names (``data/next_line_files.json``), each
    checked against its recorded sha256: another version of the package gives other prompts, and is refused."""
    man = json.loads(Path(manifest).read_text())
    import importlib.util

    spec = importlib.util.find_spec(man["package"])
    if spec is None or not spec.submodule_search_locations:
        raise InvalidInput(f"the next-line task reads files of the package {man['package']!r}, which is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    texts = []
    for entry in man["files"]:
        path = root / entry["path"]
        try:
            blob = path.read_bytes()
        except OSError:
            raise InvalidInput(
                f"{path} is missing: the next-line task needs {man['package']} {man['version']}"
            ) from None
        if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
            raise InvalidInput(
                f"{path} differs from the file the task was built on ({man['package']} {man['version']}); "
                "install that version, or rebuild the manifest and its references"
            )
        texts.append(blob.decode("utf-8", errors="replace"))
    return texts


def format_next_line_table(ev: dict, title: str = "") -> str:
    names = {
        "full": "full prefill",
        "truncate": f"truncate to {ev['settings']['refresh']}",
        "mapped_refresh": f"mapped + refresh {ev['settings']['refresh']}",
    }
    lines = [title] if title else []
    lines.append("| arm | edit similarity | exact lines | tasks |")
    lines.append("|---|---|---|---|")
    for arm, row in ev["arms"].items():
        lines.append(
            f"| {names[arm]} | {row['edit_sim']:.3f} | {row['exact']:.3f} | {len(ev['per_task'][arm]['exact'])} |"
        )
    return "\n".join(lines)
