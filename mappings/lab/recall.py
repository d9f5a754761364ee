"""Long-range recall probe: a key->value table, filler code, then a query.

The query line repeats the definition line up to the opening quote of the value, so the
answer is recoverable only by looking back more than ``min_distance`` tokens. Truncating
the context to the last 64 tokens leaves the model at chance.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ren",
    "tor",
    "vex",
    "qui",
    "zan",
    "pel",
    "dor",
    "fis",
    "gra",
    "hul",
    "jin",
    "mox",
    "nep",
    "sul",
    "tiv",
    "wex",
    "yor",
    "bri",
    "cal",
    "dun",
    "fel",
]
_VALUE_ALPHABET = string.ascii_lowercase + string.digits


@dataclass(frozen=True)
class RecallExample:
    """One probe prompt: ``prompt`` ends right where ``answer`` should start."""

    prompt: str
    answer: str


def _key(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))) + f"_{rng.randint(0, 99)}"


def _value(rng: random.Random) -> str:
    return "".join(rng.choice(_VALUE_ALPHABET) for _ in range(rng.randint(4, 6)))


def make_table(rng: random.Random, entries: int) -> list[tuple[str, str]]:
    keys: dict[str, str] = {}
    while len(keys) < entries:
        keys.setdefault(_key(rng), _value(rng))
    return list(keys.items())


def render_table(name: str, table: list[tuple[str, str]]) -> str:
    lines = [f"{name} = {{"] + [f'    "{k}": "{v}",' for k, v in table] + ["}"]
    return "\n".join(lines) + "\n"


def query_line(key: str) -> str:
    """The query repeats the definition's context exactly, up to the value's quote."""
    return f'    "{key}": "'


def make_document(rng: random.Random, filler: str, entries: int, queries: int) -> str:
    """A training document: table, filler, then several answered queries."""
    table = make_table(rng, entries)
    name = rng.choice(["CONFIG", "TABLE", "REGISTRY", "LOOKUP", "MAPPING"])
    parts = [render_table(name, table), filler.rstrip("\n") + "\n\n"]
    for key, value in rng.sample(table, k=min(queries, len(table))):
        parts.append(query_line(key) + value + '",\n')
    return "".join(parts)


def make_probe(fillers: list[str], count: int = 100, entries: int = 8, seed: int = 1234) -> list[RecallExample]:
    """Probe prompts; each filler should be well over 64 tokens of held-out code."""
    if not fillers:
        raise ValueError("make_probe needs at least one filler text (held-out code)")
    rng = random.Random(seed)
    out = []
    for i in range(count):
        table = make_table(rng, entries)
        name = rng.choice(["CONFIG", "TABLE", "REGISTRY", "LOOKUP", "MAPPING"])
        key, value = rng.choice(table)
        filler = fillers[i % len(fillers)].rstrip("\n") + "\n\n"
        out.append(RecallExample(render_table(name, table) + filler + query_line(key), value))
    return out


def probe_fillers(texts: list[str], tokenizer, count: int = 50, min_tokens: int = 80, seed: int = 7) -> list[str]:
    """Chunks of held-out code, each at least ``min_tokens`` long, to sit between table and query."""
    rng = random.Random(seed)
    docs = [t for t in texts if len(t) >= 1500]
    if not docs:
        raise ValueError("probe_fillers needs held-out texts of at least 1500 characters")
    out: list[str] = []
    for _ in range(count * 20):
        if len(out) >= count:
            break
        text = rng.choice(docs)
        start = text.find("\n", rng.randrange(0, len(text) - 1200)) + 1
        chunk = text[start : start + rng.randint(400, 900)]
        if len(tokenizer(chunk, add_special_tokens=False)["input_ids"]) >= min_tokens:
            out.append(chunk)
    return out
