"""Where kvferry's models, data and maps live: one root, never the working directory.

The root is ``KVFERRY_HOME`` when set; else the source checkout this package runs from (an editable install or a
clone: the folder above the package holding ``models/tokenizer``); else, for an installed package, a per-user data
folder (``$XDG_DATA_HOME/kvferry``, by default ``~/.local/share/kvferry``). Models fetched by ``kvferry models fetch``
go under ``<root>/models/pretrained``.
"""

from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    env = os.environ.get("KVFERRY_HOME")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    for p in (here, *here.parents):
        if (p / "models" / "tokenizer").is_dir():
            return p
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "kvferry"


def model_dir(name: str) -> Path:
    return repo_root() / "models" / name


def data_file(name: str) -> Path:
    return repo_root() / "data" / name


def maps_dir() -> Path:
    return repo_root() / "maps"
