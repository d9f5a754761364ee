import subprocess
import sys

from conftest import ROOT


def test_generated_stubs_match_the_proto():
    """Stubs are generated, never edited: a fresh generation must equal what is committed."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_layers_hold():
    """import-linter's contracts (pyproject.toml): client and sidecar never import each other, both sit on
    kvferry.common, and the math imports no gRPC, protobuf stubs or Redis. Every error class reaches client and
    sidecar through kvferry.common.errors."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "lint_imports.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout and "6 kept" in r.stdout
