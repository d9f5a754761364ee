"""Where the shipped family, data and maps live (the repository checkout)."""

from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    """KVFERRY_HOME if set, else the first folder above cwd or this package holding models/tokenizer."""
    env = os.environ.get("KVFERRY_HOME")
    if env:
        return Path(env)
    for start in (Path.cwd(), Path(__file__).resolve().parent):
        for p in (start, *start.parents):
            if (p / "models" / "tokenizer").is_dir():
                return p
    return Path.cwd()


def model_dir(name: str) -> Path:
    return repo_root() / "models" / name


def data_file(name: str) -> Path:
    return repo_root() / "data" / name


def maps_dir() -> Path:
    return repo_root() / "maps"
