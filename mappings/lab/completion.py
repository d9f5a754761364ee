"""A downstream task for code models: write the first line of a function's body, given the file before it.

Each task is a held-out source file, scrambled (:mod:`scramble`: its names become made-up words, consistently,
so that a model cannot recall the file and must read it), cut right after a function's signature and docstring.
The model writes one line greedily; the score is exact match with the file's own line (surrounding whitespace
ignored). The body's first line usually names parameters, attributes set far above, or helpers defined earlier
in the file: the context decides it, and a model that sees only the last tokens guesses.

Arms, on the same prompts (the same compute as the copy probe's):
  full            the target's own prefill of the whole prompt
  truncate        the target sees only the prompt's last r tokens
  mapped_refresh  the mapped cache for all but the last r tokens; the target recomputes those r, then writes
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..apply import apply
from ..artifact import MapSet
from ..cache import to_dynamic_cache
from ..errors import InvalidInput
from .capture import LoadedModel, capture_kv
from .memo import Memo, remembered
from .scramble import scramble

COMPLETION_ARMS = ("full", "truncate", "mapped_refresh")
_DEF = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]+\w+[ \t]*\(", re.M)


@dataclass(frozen=True)
class CompletionSettings:
    """Which functions become tasks, and how the answer is scored."""

    tasks: int = 24
    """Tasks (one function each), spread over the held-out files."""
    min_context: int = 1024
    """A function qualifies only if at least this many tokens of its file come before its body."""
    max_context: int = 3072
    """Prompts are the last this-many tokens before the body (longer files are cut at the start)."""
    refresh: int = 16
    """r: tokens the target recomputes in the truncate and mapped_refresh arms."""
    max_new_tokens: int = 32
    """Longest answer written; a line that is not finished by then is wrong."""
    seed: int = 0
    """Seeds the scrambling."""

    def __post_init__(self) -> None:
        if self.tasks < 1 or not 1 <= self.refresh < self.min_context <= self.max_context or self.max_new_tokens < 1:
            raise InvalidInput(
                "completion needs tasks >= 1, 1 <= refresh < min_context <= max_context, max_new_tokens >= 1"
            )

    def as_dict(self) -> dict:
        return {
            "tasks": self.tasks,
            "min_context": self.min_context,
            "max_context": self.max_context,
            "refresh": self.refresh,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class CompletionTask:
    prompt: list[int]
    """Token ids: the file up to the first line of the function's body (its indentation included)."""
    answer: str
    """That line, without its indentation."""


_HEADER_END = re.compile(r"\)[ \t]*(?:->[^:\n]*)?:[ \t]*(?:#[^\n]*)?\n")
_DOCSTRING = re.compile(r"[ \t]*[rRuUbB]?(\"\"\"|\'\'\'|\"|\')")


def _body_start(text: str, header_from: int) -> int | None:
    """Offset of the first body line of a ``def`` whose header starts before ``header_from`` (after its docstring, if
    any); None when the header or docstring does not close."""
    m = _HEADER_END.search(text, header_from)
    if m is None:
        return None
    pos = m.end()
    doc = _DOCSTRING.match(text, pos)
    if doc:
        quote = doc.group(1)
        close = text.find(quote, doc.end()) if len(quote) == 3 else doc.end()
        if close < 0:
            return None
        nl = text.find("\n", close + len(quote))
        pos = nl + 1 if nl >= 0 else len(text)
    while pos < len(text) and text[pos:].split("\n", 1)[0].strip() == "":
        nl = text.find("\n", pos)
        if nl < 0:
            return None
        pos = nl + 1
    return pos


def make_tasks(tokenizer, texts: list[str], s: CompletionSettings) -> list[CompletionTask]:
    """Tasks from held-out source files, taken in order, round-robin over files (one function per file per round)."""
    per_file: list[list[CompletionTask]] = []
    for text in texts:
        text = scramble(text, s.seed)
        found = []
        for m in _DEF.finditer(text):
            start = _body_start(text, m.end())
            if start is None or start >= len(text):
                continue
            line_end = text.find("\n", start)
            line = text[start : line_end if line_end >= 0 else len(text)]
            indent = len(line) - len(line.lstrip(" \t"))
            answer = line.strip()
            if not answer or answer.startswith("#") or indent <= len(m.group(1)):
                continue
            prompt = tokenizer(text[: start + indent], add_special_tokens=False)["input_ids"]
            if len(prompt) >= s.min_context:
                found.append(CompletionTask(prompt[-s.max_context :], answer))
        per_file.append(found)
    tasks: list[CompletionTask] = []
    for i in range(max((len(f) for f in per_file), default=0)):
        tasks += [f[i] for f in per_file if i < len(f)]
    if len(tasks) < s.tasks:
        raise InvalidInput(
            f"the held-out files hold {len(tasks)} functions with {s.min_context}+ tokens before their "
            f"body; {s.tasks} were asked for. Add files or lower tasks / min_context."
        )
    step = len(tasks) / s.tasks
    return [tasks[int(i * step)] for i in range(s.tasks)]


@torch.no_grad()
def write_line(model, tokenizer, ids: list[int], prefix=None, max_new_tokens: int = 32) -> str | None:
    """The line the model writes greedily after ``ids`` (``prefix``: the cache of their first tokens, which it then
    does not compute); None when no newline comes within ``max_new_tokens``."""
    cache = to_dynamic_cache(prefix, model.config) if prefix is not None else None
    inp = torch.tensor([ids])
    out = model.generate(
        inp,
        past_key_values=cache,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        stop_strings=["\n"],
        tokenizer=tokenizer,
    )  # the line is done at its newline
    text = tokenizer.decode(out[0, inp.shape[1] :])
    return text.split("\n")[0].strip() if "\n" in text else None


@torch.no_grad()
def completion_task(
    ms: MapSet | None,
    source: LoadedModel | None,
    target: LoadedModel,
    texts: list[str],
    s: CompletionSettings | None = None,
    progress: bool = False,
    memo: Memo | None = None,
) -> dict:
    """Each arm's exact-match rate on the tasks, and each task's hit (``per_task``, for the gate's interval) (``ms``
    None: only the target's own arms, which come from ``memo`` when it has them)."""
    s = s or CompletionSettings()
    tasks = make_tasks(target.tokenizer, texts, s)
    lines = written_lines(
        ms, source, target, [t.prompt for t in tasks], s.refresh, s.max_new_tokens, "completion", progress, memo
    )
    hits = {arm: [int(line == t.answer) for line, t in zip(got, tasks)] for arm, got in lines.items()}
    return {
        "settings": s.as_dict(),
        "arms": {arm: sum(h) / len(tasks) for arm, h in hits.items()},
        "per_task": hits,
        "prompt_tokens": sum(len(t.prompt) for t in tasks) / len(tasks),
    }


@torch.no_grad()
def written_lines(
    ms: MapSet | None,
    source: LoadedModel | None,
    target: LoadedModel,
    prompts: list[list[int]],
    refresh: int,
    max_new_tokens: int,
    task: str,
    progress: bool = False,
    memo: Memo | None = None,
) -> dict[str, list[str | None]]:
    """The line each arm writes after each prompt (None: not finished within ``max_new_tokens``): the target's own
    arms (full prefill and truncation to ``refresh``, kept in ``memo`` under ``task``'s name; "" when unfinished) and,
    with ``ms``, mapped + refresh."""
    lines: dict[str, list[str | None]] = {
        arm: [] for arm in COMPLETION_ARMS if ms is not None or arm != "mapped_refresh"
    }
    it = prompts
    if progress:
        from tqdm import tqdm

        it = tqdm(prompts, desc=task, unit="task")
    tok, r = target.tokenizer, refresh
    who = (target.identity.weights, target.identity.geometry.fingerprint, max_new_tokens)
    for prompt in it:
        n = len(prompt)
        for arm, ids in (("full", prompt), ("truncate", prompt[n - r :])):
            lines[arm].append(
                remembered(
                    memo,
                    (f"{task}-{arm}", *who, ids),
                    lambda: write_line(target.model, tok, ids, None, max_new_tokens) or "",
                )
            )
        if ms is not None:
            mapped = apply(ms, capture_kv(source.model, torch.tensor([prompt[: n - r]])), 0)
            lines["mapped_refresh"].append(write_line(target.model, tok, prompt, mapped, max_new_tokens))
    return lines


def format_completion_table(ev: dict, title: str = "") -> str:
    r = ev["settings"]["refresh"]
    names = {"full": "full prefill", "truncate": f"truncate to {r}", "mapped_refresh": f"mapped + refresh {r}"}
    lines = [title] if title else []
    lines.append("| " + " | ".join(names[a] for a in ev["arms"]) + " | tasks | mean prompt tokens |")
    lines.append("|" + "---|" * (len(ev["arms"]) + 2))
    lines.append(
        "| "
        + " | ".join(f"{v:.3f}" for v in ev["arms"].values())
        + f" | {ev['settings']['tasks']} | {ev['prompt_tokens']:.0f} |"
    )
    return "\n".join(lines)
