"""The rules that live in tools: ruff (lint and format, configured in pyproject.toml) and import-linter's layers."""

import subprocess
import sys

from conftest import ROOT

RUFF = [sys.executable, "-m", "ruff"]


def test_ruff_finds_nothing():
    """ruff's rules as pyproject.toml chooses them, over every Python file of the repository (the generated stubs
    excepted); a finding is fixed, not silenced."""
    r = subprocess.run(
        [*RUFF, "check", "--no-cache", "--output-format", "concise", "."], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_code_is_formatted():
    """`ruff format` leaves every file as it is (run `.venv/bin/ruff format .` to apply it)."""
    r = subprocess.run([*RUFF, "format", "--check", "--no-cache", "."], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_no_noqa_tags():
    """Rules are chosen in pyproject.toml (with their reasons), never waived line by line."""
    tagged = [
        f"{p.relative_to(ROOT)}:{n}"
        for folder in ("kvferry", "mappings", "common", "client", "sidecar", "scripts", "tests")
        for p in (ROOT / folder).rglob("*.py")
        if "_pb2" not in p.name
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "# " + "noqa" in line  # spelled apart, so this file is not its own finding
    ]
    assert not tagged, tagged


def test_layers_hold():
    """import-linter's contracts (pyproject.toml): client and sidecar never import each other, both sit on
    kvferry.common, and the math imports no gRPC, protobuf stubs or Redis. Every error class reaches client and
    sidecar through kvferry.common.errors."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "lint_imports.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout and "8 kept" in r.stdout
