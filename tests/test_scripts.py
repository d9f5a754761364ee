"""Every script under scripts/ imports (what it needs exists), and every script a shipped manifest or the docs
cite exists: provenance that runs."""

import importlib.util
import re
import sys

import pytest
from conftest import ROOT

SCRIPTS = sorted(p for p in (ROOT / "scripts").rglob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_script_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(path.parent))  # as `python scripts/x/y.py` runs it: its folder first
    monkeypatch.setattr(sys, "argv", [str(path)])
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # a script runs its work under `if __name__ == "__main__"` only


def test_every_cited_script_exists():
    cited = set()
    for doc in [
        *(ROOT / "maps").rglob("manifest.json"),
        *(ROOT / "docs").glob("*.md"),
        ROOT / "README.md",
        *(ROOT / "scripts").rglob("README.md"),
    ]:
        cited |= set(re.findall(r"scripts/[\w/]+\.(?:py|sh)", doc.read_text()))
    assert cited
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not missing, f"cited but not in the repository: {missing}"
